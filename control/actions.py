"""The vocabulary between the plane's machines and its shell (see docs/control.md).

The machines (`EpochMachine`, `Coordinator`) decide by `handle(event, now) -> list[Action]`;
they own no socket, clock, file or thread. The shell (control/plane.py) feeds them events and
time and executes their actions in order; each machine's outputs are a closed union
(`CoordinatorAction` here, `EpochAction` in control/epoch/machine.py). Requests the shell makes for a machine (`Ask`,
`Compute`) come back as `Answers` and `Computed` events carrying the request's key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .answers import PeerAnswer
from .events import PlaneEvent

__all__ = [
    "AbortRunner", "Action", "Answers", "Ask", "Compute", "Computed", "CoordinatorAction", "Emit", "LogLine", "Reply",
    "ResetLog", "Send",
]


# ---- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """Send request `msg` with `body` to every one of `peers` at once (this peer's own answer
    comes from its own handlers) and feed back one `Answers(key, ...)` once all answered or
    `timeout_s` passed, each answer typed by `read_answers` (control/answers.py); a peer that
    did not answer has `NoAnswer(why)`."""

    key: Hashable  # the machine's request key (the coordinator's: coordinator/keys.py)
    peers: tuple[bytes, ...]
    msg: int
    body: dict
    timeout_s: float


@dataclass(frozen=True)
class Send:
    """One-way message to `peer`, best effort."""

    peer: bytes
    msg: int
    body: dict


@dataclass(frozen=True)
class Compute:
    """Run `fn` off the event loop (the scheduler: seconds of CPU) and feed back
    `Computed(key, value)`, or `Computed(key, error=str(e))` when it raises ValueError."""

    key: Hashable
    fn: Callable[[], Any] = field(compare=False)


@dataclass(frozen=True)
class LogLine:
    """Append one line to the run's step log (`train.jsonl`); the shell stamps the wall time."""

    line: dict


@dataclass(frozen=True)
class ResetLog:
    """A new run starts: the step log starts empty."""


@dataclass(frozen=True)
class Emit:
    """An event of the plane (`events.jsonl` and `dtfm-swarm events`)."""

    record: PlaneEvent

    @property
    def event(self) -> str:
        return self.record.kind.value

    @property
    def fields(self) -> Mapping[str, Any]:
        return self.record.to_wire()


@dataclass(frozen=True)
class Reply:
    """The outcome of an operator's request the shell is waiting on: `value`, or `error`."""

    key: tuple
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class AbortRunner:
    """Abort the current epoch's step (and its comm); a runner not started is cancelled."""

    reason: str


Action = Ask | Send | Compute | LogLine | ResetLog | Emit | Reply

# Everything `Coordinator.handle` returns (the epoch machine's are `EpochAction`, beside its own
# actions in control/epoch/machine.py): the shell executes each, and a type checker proves it
# does (control/plane.py's `_execute_now` ends with `assert_never`).
CoordinatorAction = Ask | Compute | LogLine | ResetLog | Emit | Reply | AbortRunner


# ---- events that answer the shell's requests ------------------------------------------------


@dataclass(frozen=True)
class Answers:
    """The typed answers to the request `key` (`Ask`), one per asked peer."""

    key: Hashable
    answers: Mapping[bytes, PeerAnswer]


@dataclass(frozen=True)
class Computed:
    key: Hashable
    value: Any = None
    error: str | None = None
