"""The errors of a `Comm` and the peer ids it addresses: light types (no torch) that the
control plane names before any stage exists."""

from __future__ import annotations

from typing import Hashable

__all__ = ["CommClosed", "CommError", "CommTimeout", "PeerId", "raised_again"]

PeerId = Hashable  # str or bytes in practice


class CommError(Exception):
    """A message could not be sent or received."""


class CommTimeout(CommError, TimeoutError):
    """No message arrived (or no room to send) within the timeout."""


class CommClosed(CommError):
    """The communicator was closed or aborted while waiting."""


def raised_again(error: BaseException, what: str) -> CommError:
    """A new exception to raise for a failure one object recorded (a send's stream broke) and
    each of its waiters reports: a `CommError` like `error`, else one that names `what` and
    carries it as its cause.

    Never the recorded object itself: raising it gives it the waiter's frames as its traceback,
    and those frames hold the failed step (its activations, their autograd graph, the gradients)
    for as long as the recorder keeps the error, which reaches back to it through those frames:
    a cycle only a full collection frees, after the memory has been counted against the daemon."""
    if isinstance(error, CommError):
        return type(error)(*error.args)
    fresh = CommError(f"could not {what}: {error}")
    fresh.__cause__ = error
    return fresh
