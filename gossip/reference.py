"""The reference transformer block a peer's compute figure (`compute_ms`) times, and its timing.

The scheduler turns the figure into the peer's speed by the block's FLOPs (control/compute.py);
a run's own layer is timed against it the same way (`kind_factors`). torch is imported only
when a block is built: importing this module loads neither torch nor trio.
"""

from __future__ import annotations

import hashlib
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PROBE_MIN_RUNS", "PROBE_MIN_S", "REFERENCE_BLOCK", "cpu_share", "host_fingerprint", "mean_ms",
           "reference_block", "time_block_ms"]

# width, heads, sequence length and batch
REFERENCE_BLOCK = (256, 4, 128, 4)
# A figure is the mean of at least PROBE_MIN_RUNS timed runs spanning at least PROBE_MIN_S
# (at most PROBE_MAX_RUNS): on a loaded machine one run of a few ms is one time slice more or
# less; a second of runs sees the load as the training will, and its mean the share it gets.
PROBE_MIN_RUNS = 3
PROBE_MIN_S = 1.0
PROBE_MAX_RUNS = 200


def reference_block(d_model: int = REFERENCE_BLOCK[0], n_heads: int = REFERENCE_BLOCK[1],
                    seq_len: int = REFERENCE_BLOCK[2], batch: int = REFERENCE_BLOCK[3], seed: int = 0) -> tuple:
    """(the transformer block the compute figure times, its input), torch imported here."""
    import torch  # lazily: only the probes need torch

    torch.manual_seed(seed)
    block = torch.nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True)
    return block, torch.randn(batch, seq_len, d_model)  # (B, T, C)


def time_block_ms(block: Any, x: Any) -> float:
    """One forward and backward of `block` on `x`, in ms (its gradients cleared after)."""
    t0 = time.perf_counter()
    block(x).sum().backward()
    out = (time.perf_counter() - t0) * 1000.0
    block.zero_grad(set_to_none=True)
    return out


def mean_ms(run: Callable[[], float], *, min_runs: int = PROBE_MIN_RUNS, min_s: float = PROBE_MIN_S,
              max_runs: int = PROBE_MAX_RUNS) -> float:
    """The mean of `run()`'s figures, called at least `min_runs` times and until `min_s`
    seconds have passed (at most `max_runs` times)."""
    t0 = time.perf_counter()
    figures = [run()]
    while len(figures) < max_runs and (len(figures) < min_runs or time.perf_counter() - t0 < min_s):
        figures.append(run())
    return statistics.fmean(figures)


def host_fingerprint() -> bytes:
    """This machine, as the compute figures of its daemons share it: 8 bytes of a keyed hash of
    the kernel's boot id and the host name (daemons of one machine and boot give the same
    bytes; nothing of either can be read back from them); b"" where neither can be read."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path, "rb") as f:
                parts.append(f.read(256).strip())
        except OSError:
            parts.append(b"")
    parts.append(socket.gethostname().encode(errors="replace"))
    if not any(parts[:2]):
        return b""
    return hashlib.blake2b(b"\x00".join(parts), digest_size=8, person=b"dtfm-host").digest()


def cpu_share(seconds: float = 0.5) -> float:
    """The share of a core one busy thread gets now: its CPU time over its wall time while it
    spins for `seconds` (1.0 on an idle machine; 0.5 where it shares a core with one other busy
    thread)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        pass
    wall = time.perf_counter() - t0
    return min(1.0, max(1e-3, (time.thread_time() - c0) / wall))
