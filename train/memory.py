"""What a stage's memory is made of, and handing freed heap memory back to the system.

`StageMemory` is a stage's own state in bytes: its weights, their gradients, the optimizer's
moments (and a compressed run's buffers), the one-step-back snapshot the runner keeps
(control/epoch/runner.py), and the activations its micro-batches saved for backward in the last
step. A peer's resident memory is measured against it (`dtfm-peer status`, bench/memory.py).

torch's CPU allocator is the C library's malloc. glibc serves a request below its mmap
threshold from an arena (one per thread that allocates, up to eight per core), and the
threshold rises to the size of the largest block freed so far (up to 32 MiB): after the first
step nearly every activation, gradient bucket and decoded tensor lives in an arena, and once
freed it stays in the process unless it lies at the very top of its heap, and a thread's arena
keeps up to twice that threshold free at the top of each of its 64 MiB heaps, which
`malloc_trim` does not reach. A daemon's stage is stepped by worker threads: its tensors spread
over dozens of such heaps. `limit_heap_caching()` fixes both thresholds (glibc's `mallopt`,
M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, 1 MiB): every block of 1 MiB or more is mapped on its
own and unmapped when freed, so resident memory follows the live tensors; the cost is a page
fault per fresh page of such a block. `release_heap()` (glibc's `malloc_trim(0)`) gives the
free pages inside every arena back to the system; the daemon's stage runner calls it every
few dozen steps, after each checkpoint and where a run ends. Where the C library is not glibc
both do nothing.

This module imports no torch: the daemon's status reads `StageMemory` without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["StageMemory", "limit_heap_caching", "release_heap", "stage_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


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
    trim = getattr(_libc(), "malloc_trim", None)  # (not glibc: none)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def limit_heap_caching(threshold_bytes: int = 1 << 20) -> bool:
    """Map every allocation of `threshold_bytes` or more on its own, and trim a heap's free top
    beyond it (glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, which also stop glibc from raising
    them); whether it could be set (False where the C library has no mallopt)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold_bytes))


def release_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's malloc_trim(0)); whether it
    could be asked (False where the C library has no malloc_trim)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
