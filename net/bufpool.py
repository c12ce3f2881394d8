"""`BufferPool`: receive buffers for large payloads, recycled once the application drops them.

A fresh buffer costs the kernel a page fault and a zeroed page for every 4 KiB the first
chunk lands on, about as much CPU as opening (decrypting) those bytes. Training sends tensors of
the same few sizes step after step, so a buffer given back when its payload dies is, most of
the time, exactly the one the next payload needs, with its pages already in place.

A buffer is handed out as a `memoryview` of a numpy array that shares the pooled memory; every
view, slice, numpy array or torch tensor made from it keeps that array alive, and only when the
array is gone does the memory return to the pool (from whichever thread dropped it). A returned
buffer still holds the old payload's bytes; the receiver overwrites all of it before it hands
the new payload out. Free buffers are kept up to `max_bytes`, and at most `per_size` of each
size (two by default: one being filled while the application holds the last); beyond that they
are released. So the pool holds what a steady stream of payloads reuses, not what a burst once
needed: after a ring all-reduce received dozens of buckets at once, or a stage transfer hundreds
of chunks, all but two of a size go back to the system. And only a stream: a buffer returns to
the pool when its size was taken before within `recur_s` (30 s), so a lone payload (a bandwidth
probe every few minutes, a stage fetched once) leaves no memory behind on an idle connection.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

__all__ = ["BufferPool", "alloc_buffer"]


def alloc_buffer(n: int) -> memoryview:
    """A writable byte buffer of `n` bytes without zero-filling it up front.

    `bytearray(n)` writes every byte before use, which for a large payload both costs as much
    as decrypting it and blocks the event loop; numpy's allocation leaves pages untouched until
    chunks land in them.
    """
    return np.empty(n, dtype=np.uint8).data


SIZES_REMEMBERED = 64  # sizes whose last take the pool remembers (the least recent forgotten)


class BufferPool:
    def __init__(self, max_bytes: int, min_buffer_bytes: int = 1 << 20, per_size: int = 2, recur_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes  # free buffers kept, in bytes
        self.min_buffer_bytes = min_buffer_bytes  # smaller buffers are not pooled
        self.per_size = per_size  # free buffers kept of any one size
        self.recur_s = recur_s  # a size taken again within this is a stream, worth keeping buffers of
        self.free_bytes = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._taken_at: OrderedDict[int, float] = OrderedDict()  # size -> its last take
        self._clock = clock
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview:
        """A buffer of `n` bytes, recycled when one of that size is free; contents undefined."""
        if n < self.min_buffer_bytes or self.max_bytes < n:
            return alloc_buffer(n)
        now = self._clock()
        with self._lock:
            free = self._free.get(n)
            memory = free.pop() if free else None
            if memory is not None:
                self.free_bytes -= n
            last = self._taken_at.pop(n, None)
            self._taken_at[n] = now
            if len(self._taken_at) > SIZES_REMEMBERED:
                self._taken_at.popitem(last=False)
        stream = last is not None and now - last <= self.recur_s
        if memory is None:
            memory = np.empty(n, dtype=np.uint8)
        handed = memory.view()  # the exporter of every view: the memory returns when it dies
        weakref.finalize(handed, self._give_back, memory, stream).atexit = False
        return handed.data

    def _give_back(self, memory: np.ndarray, stream: bool) -> None:
        if not stream:  # (a lone payload's buffer goes back to the system)
            return
        with self._lock:
            free = self._free.setdefault(memory.nbytes, [])
            if self.free_bytes + memory.nbytes <= self.max_bytes and len(free) < self.per_size:
                free.append(memory)
                self.free_bytes += memory.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.free_bytes = 0
