"""Host-staged transfers: how a CUDA stage's boundary tensors reach the `Comm` and come back.

Every `Comm` takes and returns CPU tensors (the wire is bytes in host memory), so a stage on a
GPU moves each activation it sends, and each activation gradient, device -> host, and each one
it receives host -> device. Done plainly (`t.to("cpu")` in `isend`), the copy blocks the stage's
thread until the GPU has finished everything queued before it, the micro-batch's compute
included, and goes through pageable memory. `HostStaging` does it the way that overlaps:

- send: the tensor is copied into a pinned (page-locked) host buffer by a `non_blocking` copy
  on a side CUDA stream that first waits for the compute stream (so it copies the finished
  values), and an event is recorded after it. The stage's thread returns at once and launches
  the next micro-batch; one worker thread per stage waits for each event in order and hands
  the pinned buffer to `comm.isend` (which copies it, as every Comm does), then the buffer goes
  back to the pool. The handle `send` returns completes when that isend's handle does.
- receive: the CPU tensor is copied into a pinned buffer and uploaded by a `non_blocking` copy
  on the side stream; the compute stream waits for it on the GPU (`wait_stream`), not the CPU.

Buffers are pooled by (dtype, elements): a pipeline sends the same few shapes step after step.
A buffer whose upload may still be running is reused only after its event. On a CPU stage
(and for a CPU tensor) every call is the plain path: `send` is `comm.isend`, `to_device` is
`.to(device, dtype)`, no thread, no pool. NCCL is not used: the host path works between any
two peers, whatever their devices (docs/train.md).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .comm import Comm, CommTimeout, PeerId, SendHandle
from .errors import raised_again

__all__ = ["HostStaging", "StagedSend"]


class StagedSend:
    """The handle of a staged send: done when the worker has handed the tensor to the Comm and
    that send's own handle is done."""

    def __init__(self, what: str):
        self.what = what
        self._handed = threading.Event()
        self._inner: SendHandle | None = None
        self._error: BaseException | None = None

    def handed(self, inner: SendHandle) -> None:
        self._inner = inner
        self._handed.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._handed.set()

    def wait(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        if not self._handed.wait(timeout_s):
            raise CommTimeout(f"timed out after {timeout_s} s waiting to stage {self.what}")
        if self._error is not None:
            raise raised_again(self._error, self.what)
        assert self._inner is not None
        self._inner.wait(max(0.0, timeout_s - (time.monotonic() - t0)))


class HostStaging:
    """Pinned host buffers, a side CUDA stream and one hand-over thread for one stage (see the
    module docstring). `enabled` only on a CUDA device; `plain=True` forces the plain path (the
    baseline benchmarks compare with)."""

    def __init__(self, device: torch.device | str, *, plain: bool = False, pool_bytes: int = 512 << 20):
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda" and not plain
        self.pool_bytes = pool_bytes  # free pinned bytes kept for reuse; more are freed
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.dtype, int], list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._free_bytes = 0
        self._stream: torch.cuda.Stream | None = None
        self._worker: ThreadPoolExecutor | None = None
        self.bytes_down = self.bytes_up = 0  # bytes staged device -> host and host -> device

    # ---- pool ------------------------------------------------------------------------------

    def _take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get((dtype, numel))
            entry = free.pop() if free else None
            if entry is not None:
                self._free_bytes -= numel * dtype.itemsize
        if entry is None:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        buf, busy = entry
        if busy is not None:
            busy.synchronize()  # an upload from it may still be running
        return buf

    def _give(self, buf: torch.Tensor, busy: torch.cuda.Event | None = None) -> None:
        nbytes = buf.numel() * buf.dtype.itemsize
        with self._lock:
            if self._free_bytes + nbytes > self.pool_bytes:
                return  # dropped: freed by torch once unreferenced
            self._free.setdefault((buf.dtype, buf.numel()), []).append((buf, busy))
            self._free_bytes += nbytes

    def _side(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    # ---- the two directions --------------------------------------------------------------

    def send(self, comm: Comm, peer: PeerId, tag: str, t: torch.Tensor) -> SendHandle:
        """`comm.isend(peer, tag, t)`, with `t` staged through pinned memory when it is on the GPU."""
        if not self.enabled or t.device.type != "cuda":
            return comm.isend(peer, tag, t)
        src = t.detach().contiguous()
        host = self._take(src.dtype, src.numel())
        side = self._side()
        side.wait_stream(torch.cuda.current_stream(self.device))  # the values are computed first
        with torch.cuda.stream(side):
            host.copy_(src.reshape(-1), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        src.record_stream(side)  # its memory is not reused before the copy has read it
        self.bytes_down += host.numel() * host.dtype.itemsize
        handle = StagedSend(f"send {tag!r} to {peer!r}")
        if self._worker is None:  # one thread: the hand-overs keep the order of the sends
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtfm-stage-send")
        self._worker.submit(self._hand_over, ready, comm, peer, tag, host, tuple(src.shape), handle)
        return handle

    def _hand_over(self, ready: torch.cuda.Event, comm: Comm, peer: PeerId, tag: str, host: torch.Tensor,
                   shape: tuple[int, ...], handle: StagedSend) -> None:
        try:
            ready.synchronize()
            handle.handed(comm.isend(peer, tag, host.view(shape)))  # copied by isend: the buffer is free again
        except BaseException as e:  # (the step that waits for the handle raises it)
            handle.fail(e)
        finally:
            self._give(host)

    def to_device(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`t` (a received CPU tensor) on this stage's device in `dtype`, uploaded through a pinned
        buffer; the compute stream waits for the upload on the GPU. (The conversion to `dtype`
        happens on the device, after the upload of the smaller wire dtype.)"""
        if not self.enabled or t.device.type == "cuda":
            return t.to(self.device, dtype)
        host = self._take(t.dtype, t.numel())
        host.copy_(t.reshape(-1))
        side, compute = self._side(), torch.cuda.current_stream(self.device)
        with torch.cuda.stream(side):
            out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            out.copy_(host.view(t.shape), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        compute.wait_stream(side)
        out.record_stream(compute)  # allocated on the side stream, used on the compute stream
        self._give(host, done)
        self.bytes_up += host.numel() * host.dtype.itemsize
        return out.to(dtype)

    def close(self) -> None:
        """Let the hand-over thread end once the sends queued so far are handed over."""
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None
