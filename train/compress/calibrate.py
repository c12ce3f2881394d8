"""What coding costs on this CPU, in the scheduler's terms (`dtfm.sched.CodecSpeed`).

`measure_compress_cost()` times the codec's own functions on a representative tensor (a
normal float32 vector with a few large outliers, as activations have) and returns nanoseconds
per element: int8 and int4 encode and decode, the Hadamard rotation's extra, and the sparse
DP codec's encode (top-k, quantize, pack) and decode, per candidate. The best of `repeats`
runs is kept (the least disturbed by other work). The scheduler takes the figure as input;
it never runs this itself (`bench/compress_sched.py --codec-speed-out FILE` writes the JSON
that `dtfm-sched --codec-speed FILE` reads).

`peer_codec_speed()` is the daemon's probe, run once at start in a worker thread and gossiped
with its measurements (on the daemon's `--device`: a GPU stage codes on its GPU, so a daemon
with `--device cuda` measures there, with the same vector on the wire): `PROBE_ELEMENTS` (256 Ki, 1 MiB of float32) best of `PROBE_REPEATS`
(3), 0.07-0.11 s on the 2-core development machine (4 Mi elements: 1.5-1.8 s), so well under
a second on a CPU several times slower. On that machine its sparse and decode figures agree
with the 4 Mi-element ones within the run-to-run noise; its int8/int4 encode figures read
lower (1.3-3.6 against 2.9-7.2 ns per element: a 1 MiB tensor stays in cache, as a
micro-batch's activations of a small model do). Smaller tensors would pay a larger share of
per-call overhead.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from dtfm.sched import CodecSpeed

from .codec import decode_dense, decode_sparse, encode_dense, encode_sparse

__all__ = ["PROBE_ELEMENTS", "PROBE_ELEMENTS_GPU", "PROBE_REPEATS", "measure_compress_cost", "peer_codec_speed"]

PROBE_ELEMENTS = 1 << 18  # the daemon's probe: large enough to amortise per-call overhead
PROBE_REPEATS = 3  # best of: one disturbed run does not count
# On a GPU the probe's 256 Ki elements measure kernel launches, not coding: on an H200 they read
# 1.1-2.8 ns per element against 0.08-0.26 at 4 Mi (bench/gpu.py, docs/figures.md), and 4 Mi
# elements (16 MiB, an activation of gpt3-xl) take milliseconds there.
PROBE_ELEMENTS_GPU = 1 << 22


def _best_ns(fn: Callable[[], object], repeats: int, numel: int, device: torch.device) -> float:
    """Best wall time of `fn` over `repeats` runs, per element; on a GPU until its work is done."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: allocations, first-call dispatch (on a GPU: kernel loading)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best * 1e9 / numel


def measure_compress_cost(elements: int = 1 << 22, repeats: int = 3, *, block_elems: int = 64,
                          chunk_elems: int = 1024, topk_fraction: float = 0.25, value_bits: int = 4,
                          seed: int = 0, device: str | torch.device = "cpu") -> CodecSpeed:
    """Nanoseconds per element of each codec on `device`: this CPU with torch's current thread
    count, or a GPU (the tensor there, the payloads made and decoded there, as a GPU stage codes)."""
    if elements < chunk_elems or repeats < 1:
        raise ValueError(f"need at least {chunk_elems} elements and one repeat")
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(elements, generator=g)
    x[:: max(1, elements // 64)] *= 50.0  # outliers
    x = x.to(dev)
    n = elements
    out: dict[str, float] = {}
    for method in ("int8", "int4"):
        payload = encode_dense(x, method, block_elems, False)
        out[f"{method}_encode_ns_per_elem"] = _best_ns(lambda: encode_dense(x, method, block_elems, False), repeats, n, dev)
        out[f"{method}_decode_ns_per_elem"] = _best_ns(lambda: decode_dense(payload, (n,), method, block_elems, False),
                                                       repeats, n, dev)
    plain = out["int4_encode_ns_per_elem"] + out["int4_decode_ns_per_elem"]
    rotated = encode_dense(x, "int4", block_elems, True)
    both = (_best_ns(lambda: encode_dense(x, "int4", block_elems, True), repeats, n, dev)
            + _best_ns(lambda: decode_dense(rotated, (n,), "int4", block_elems, True), repeats, n, dev))
    out["hadamard_ns_per_elem"] = max(0.0, (both - plain) / 2)
    k = max(1, round(topk_fraction * chunk_elems))
    sparse = encode_sparse(x, chunk_elems, k, value_bits)
    out["sparse_encode_ns_per_elem"] = _best_ns(lambda: encode_sparse(x, chunk_elems, k, value_bits), repeats, n, dev)
    out["sparse_decode_ns_per_elem"] = _best_ns(lambda: decode_sparse(sparse, n, chunk_elems, k, value_bits),
                                                repeats, n, dev)
    return CodecSpeed(**out)


def peer_codec_speed(torch_threads: int = 1, device: str = "cpu") -> CodecSpeed:
    """This peer's coding speed where its stage codes: on its CPU with the torch thread count its
    stage worker codes with (the count is process-wide; the worker sets the same), or on its GPU
    (`device` cuda or cuda:N; a stage there encodes and decodes on the device). Blocking: run
    it in a worker thread."""
    torch.set_num_threads(torch_threads)
    elements = PROBE_ELEMENTS if torch.device(device).type == "cpu" else PROBE_ELEMENTS_GPU
    return measure_compress_cost(elements, PROBE_REPEATS, device=device)
