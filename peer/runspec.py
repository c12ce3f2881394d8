"""A run spec: what `dtfm-peer train start` asks for, as flags or as a TOML file
(`train start --spec run.toml`), read with the daemon config's strictness: an unknown key, a
wrong type or a value out of range is named, and the command exits 2.

The file's keys are the flags' names with underscores; a flag given on the command line wins
over the file's key, as `join` flags win over the daemon's config file. `start_request` turns
the resolved values into the arguments of the operator's signed start (`TrainRequest.to_args`'s
keys: the training knobs by their `TrainConfig` names, each only where it differs from the
default, so a start that sets none signs what it signed before). docs/train.md has an example.

    preset = "tiny"          # or init_from = "gpt2-small/" (a Hugging Face folder; no preset)
    steps = 300
    lr = 3e-4
    warmup_steps = 30
    batch = 32               # sequences per step over all pipelines
    micro_batches = 4        # or "auto" (the default): the scheduler chooses
    wire_dtype = "bfloat16"
    weight_decay = 0.1
    grad_clip = 1.0
    precision = "bf16"       # mixed precision (fp32, the default, is exact)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

from dtfm.train import PRECISIONS, PRESETS, WIRE_DTYPES, TrainConfig

from .config import ConfigError, read_toml
from .control_client import DEPOSED

__all__ = ["KNOB_FLAGS", "PLACEMENT_CHOICES", "RUN_SPEC_KEYS", "START_ATTEMPTS", "SpecKey", "init_folder",
           "load_run_spec", "resolve", "send_start", "start_request"]

START_ATTEMPTS = 3  # a start the swarm's election interrupted is signed and sent again

PLACEMENT_CHOICES = ("scheduler", "random")  # dtfm.control.PLACEMENTS, without importing the plane


@dataclass(frozen=True)
class SpecKey:
    """One key of a run spec: its type and range, its default, and the signed argument it sets."""

    kind: type  # int, float, str, Path
    default: Any
    low: float | None = None  # inclusive lower bound of a number
    positive: bool = False  # a number > 0 (lr)
    choices: tuple[str, ...] = ()
    arg: str = ""  # the signed start's argument; "": the key's own name
    auto: bool = False  # also takes "auto": the scheduler chooses (stages, micro_batches)

    def check(self, where: str, value: Any, base_dir: Path | None) -> Any:
        """`value` as this key's type; ConfigError naming `where` when it is not one."""
        if self.kind is Path:
            if type(value) is not str or not value:
                raise ConfigError(f"{where} must be a path, got {value!r}")
            p = Path(value).expanduser()
            return p if p.is_absolute() or base_dir is None else base_dir / p
        if self.auto and value == "auto":
            return value
        if self.kind is float:
            if type(value) not in (int, float) or not math.isfinite(value):
                raise ConfigError(f"{where} must be a number, got {value!r}")
            value = float(value)
        elif self.kind is int:
            if type(value) is not int:
                raise ConfigError(f"{where} must be an integer" + (" or \"auto\"" if self.auto else "")
                                  + f", got {value!r}")
        elif type(value) is not str:
            raise ConfigError(f"{where} must be a string, got {value!r}")
        if self.positive and not value > 0:
            raise ConfigError(f"{where} must be positive, got {value!r}")
        if self.low is not None and value < self.low:
            names: dict[tuple[type, float], str] = {(int, 1): "a positive integer", (int, 0): "a non-negative integer",
                                                    (float, 0): "a non-negative number"}
            what = names.get((self.kind, self.low), f"at least {self.low:g}")
            raise ConfigError(f"{where} must be {what}, got {value!r}")
        if self.choices and value not in self.choices:
            raise ConfigError(f"{where} {value!r}: choose one of {', '.join(self.choices)}")
        return value


_D = TrainConfig()

# The keys of a run spec, in the order `--help` lists them; each is also a `train start` flag.
RUN_SPEC_KEYS: dict[str, SpecKey] = {
    "preset": SpecKey(str, "tiny", choices=tuple(sorted(PRESETS))),
    "init_from": SpecKey(Path, None),
    "steps": SpecKey(int, 100, low=1),
    "seed": SpecKey(int, 0, low=0),
    "stages": SpecKey(int, "auto", low=1, auto=True),
    "dp": SpecKey(int, None, low=1),
    "checkpoint_every": SpecKey(int, None, low=0),
    "placement": SpecKey(str, "scheduler", choices=PLACEMENT_CHOICES),
    "compress": SpecKey(str, None),
    "min_peers": SpecKey(int, 1, low=1),
    "lr": SpecKey(float, _D.lr, positive=True),
    "warmup_steps": SpecKey(int, _D.warmup_steps, low=0),
    "batch": SpecKey(int, _D.global_batch_seqs, low=1, arg="global_batch_seqs"),
    # auto: the scheduler chooses it with the shape (the fastest predicted step); N: exactly N
    "micro_batches": SpecKey(int, "auto", low=1, auto=True),
    "wire_dtype": SpecKey(str, _D.wire_dtype, choices=WIRE_DTYPES),
    "weight_decay": SpecKey(float, _D.weight_decay, low=0),
    "grad_clip": SpecKey(float, _D.grad_clip_norm, low=0, arg="grad_clip_norm"),
    "precision": SpecKey(str, _D.precision, choices=PRECISIONS),
}

# The training knobs (TrainConfig fields): flag key -> help, from TrainConfig's own help texts.
KNOB_FLAGS: dict[str, str] = {
    key: TrainConfig.__dataclass_fields__[k.arg or key].metadata["help"]
    + ("; auto: the scheduler chooses it with the shape, for the fastest predicted step" if k.auto else "")
    for key, k in RUN_SPEC_KEYS.items() if (k.arg or key) in TrainConfig.__dataclass_fields__ and key != "seed"
}


def load_run_spec(path: Path) -> dict[str, Any]:
    """The keys of the run spec file at `path`, typed and checked (a relative init_from is
    relative to the file's folder); ConfigError names the file and the key."""
    raw = read_toml(path, "run spec")
    out = {}
    for key, value in raw.items():
        spec = RUN_SPEC_KEYS.get(key)
        if spec is None:
            hint = " (a table: a run spec's keys are top-level)" if isinstance(value, dict) else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}; known: {', '.join(RUN_SPEC_KEYS)}")
        out[key] = spec.check(f"{path}: {key}", value, path.resolve().parent)
    if "preset" in out and "init_from" in out:
        raise ConfigError(f"{path}: preset and init_from both name the model: keep one")
    return out


def resolve(flags: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Every key's value: the flag's where given (not None), else the spec file's, else the
    default. A preset flag over a file's init_from (or the reverse) replaces it."""
    if flags.get("preset") is not None:
        spec = {k: v for k, v in spec.items() if k != "init_from"}
    if flags.get("init_from") is not None:
        spec = {k: v for k, v in spec.items() if k != "preset"}
    return {key: (flags[key] if flags.get(key) is not None else spec.get(key, k.default))
            for key, k in RUN_SPEC_KEYS.items()}


def start_request(values: dict[str, Any]) -> dict[str, Any]:
    """The signed start's arguments for resolved values (`resolve`), without the data hash,
    the model folder's digest and the waits, which the caller adds."""
    out: dict[str, Any] = {"steps": values["steps"], "seed": values["seed"],
                           "checkpoint_every": values["checkpoint_every"], "placement": values["placement"]}
    if values["init_from"] is None:
        out["preset"] = values["preset"]
    if values["stages"] != "auto":
        out["stages"] = values["stages"]
    if values["dp"] is not None:
        out["dp"] = values["dp"]
    if values["compress"] is not None and values["compress"] != "exact":
        out["compress"] = values["compress"]
    for key in KNOB_FLAGS:
        k = RUN_SPEC_KEYS[key]
        if values[key] != k.default or (k.auto and values[key] == "auto"):  # (auto is signed: absent is the fixed default)
            out[k.arg or key] = values[key]
    return out


def init_folder(path: Path) -> tuple[str, str]:
    """(digest, name) of the Hugging Face model folder a start names (`--init-from`); ConfigError
    for a folder dtfm cannot compute, before its weights are hashed."""
    from dtfm.train import HFError, hf_digest, load_hf_spec  # (torch: only for a model folder)
    try:
        load_hf_spec(path)
        return hf_digest(path), path.resolve().name
    except HFError as e:
        raise ConfigError(f"--init-from (init_from): {e}") from None


T = TypeVar("T")


def send_start(send: Callable[[], T], term: Callable[[], int | None], errors: tuple[type[Exception], ...],
               say: Callable[[str], None], attempts: int = START_ATTEMPTS) -> T:
    """`send()` an operator's start (each call signs a new one) and return its answer. When it
    fails (one of `errors`) and the daemon's election `term()` moved meanwhile, an election
    deposed the coordinator while it handed the run out (on a loaded machine, say): the
    allocation of the deposed term was refused, so no run started, and a start taken once is
    never taken again; it is signed and sent again, `attempts` in all, each retry `say`d. A
    swarm's first election (term 0 before it: no coordinator had the start) deposes nobody: a
    start that fails across it fails, unless the daemon's refusal says (code DEPOSED) that the
    coordinator which had it was replaced before the run started."""
    for attempt in range(1, attempts + 1):
        before = term()
        try:
            return send()
        except errors as e:
            now = term()
            moved = before is not None and before > 0 and now is not None and now > before
            if attempt == attempts or not (moved or getattr(e, "code", None) == DEPOSED):
                raise
            say(f"{e}\nthe coordinator changed while it handed the run out"
                f"{f' (term {before} -> {now})' if moved else ''}: "
                f"starting again with a new signed start ({attempt + 1} of {attempts})")
    raise AssertionError("unreachable")
