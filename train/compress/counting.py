"""Bytes put on the wire, per axis, counted where they are sent.

`CountingComm` wraps any `Comm` and adds the payload size of every tensor it sends (the bytes
that travel after the message header: a compressed payload's real length, a float tensor's
elements) to a shared `ByteCounter`, by the axis its tag names: `pp_fwd` (act/), `pp_bwd`
(grad/), `dp` (dp/ and dpc/), `other` (loss, norm, tied embedding).
"""

from __future__ import annotations

import threading

import torch

from ..comm import Comm, PeerId, SendHandle

__all__ = ["AXES", "ByteCounter", "CountingComm", "axis_of"]

AXES = ("pp_fwd", "pp_bwd", "dp", "other")


def axis_of(tag: str) -> str:
    """The axis of a message tag "<epoch>.<step>/<what>"."""
    what = tag.split("/", 1)[1] if "/" in tag else tag
    head = what.split("/", 1)[0]
    return {"act": "pp_fwd", "grad": "pp_bwd", "dp": "dp", "dpc": "dp"}.get(head, "other")


class ByteCounter:
    """Bytes and messages sent per axis; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = dict.fromkeys(AXES, 0)
        self.messages = dict.fromkeys(AXES, 0)

    def add(self, axis: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[axis] += nbytes
            self.messages[axis] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.bytes)


class CountingComm:
    """A `Comm` that counts what it sends into a `ByteCounter`."""

    def __init__(self, comm: Comm, counter: ByteCounter):
        self.comm, self.counter = comm, counter

    @property
    def me(self) -> PeerId:
        return self.comm.me

    def isend(self, peer: PeerId, tag: str, tensor: torch.Tensor) -> SendHandle:
        handle = self.comm.isend(peer, tag, tensor)
        self.counter.add(axis_of(tag), tensor.numel() * tensor.element_size())
        return handle

    def recv(self, peer: PeerId, tag: str, timeout_s: float) -> torch.Tensor:
        return self.comm.recv(peer, tag, timeout_s)
