"""What a stage's memory is made of, and handing freed heap memory back to the system.

`StageMemory` is a stage's own state in bytes: its weights, their gradients, the optimizer's
moments (and a compressed run's buffers), the one-step-back snapshot the runner keeps
(control/epoch/runner.py), and the activations its micro-batches saved for backward in the last
step. A peer's resident memory is measured against it (`dtfm-peer status`, bench/memory.py).

torch's CPU allocator is the C library's malloc. glibc serves a request below its mmap
threshold from an arena (one per thread that allocates, up to eight per core), and the
threshold rises to the size of the largest block freed so far (up to 32 MiB): after the first
step nearly every activation, gradient bucket and decoded tensor lives in an arena, and once
freed it stays in the process unless it lies at the very top of its heap. `release_heap()`
(glibc's `malloc_trim(0)`) gives the free pages of every arena back to the system; the runner
calls it after each step and each checkpoint, the stage host after a stage was built or
encoded. Where the C library is not glibc it does nothing.

This module imports no torch: the daemon's status reads `StageMemory` without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["StageMemory", "release_heap", "stage_memory"]


@dataclass(frozen=True)
class StageMemory:
    """A stage's own state, in bytes."""

    weights: int
    grads: int
    optimizer: int  # the AdamW moments and a compressed run's buffers
    snapshot: int  # the runner's copy of the stage as it was before its last step
    activations: int  # saved for backward by the micro-batches of the last step, at their peak

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.snapshot + self.activations

    def to_wire(self) -> dict[str, int]:
        return {"stage_bytes": self.total, "weights_bytes": self.weights, "grads_bytes": self.grads,
                "optimizer_bytes": self.optimizer, "snapshot_bytes": self.snapshot,
                "activations_bytes": self.activations}


def _nbytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def stage_memory(state: Any, snapshot_bytes: int, activations_bytes: int) -> StageMemory:
    """The `StageMemory` of a `StageState`: the gradients counted at the weights' size (a step
    makes one per parameter, and they stay until the next step clears them)."""
    weights = _nbytes(state.params.values())
    optimizer = _nbytes(state.optim.state_tensors().values()) + _nbytes(state.compress.state_tensors().values())
    return StageMemory(weights, weights, optimizer, snapshot_bytes, activations_bytes)


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):  # not glibc
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's malloc_trim(0)); whether it
    could be asked (False where the C library has no malloc_trim)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
