"""The errors of a `Comm` and the peer ids it addresses: light types (no torch) that the
control plane names before any stage exists."""

from __future__ import annotations

from typing import Hashable

__all__ = ["CommClosed", "CommError", "CommTimeout", "PeerId"]

PeerId = Hashable  # str or bytes in practice


class CommError(Exception):
    """A message could not be sent or received."""


class CommTimeout(CommError, TimeoutError):
    """No message arrived (or no room to send) within the timeout."""


class CommClosed(CommError):
    """The communicator was closed or aborted while waiting."""
