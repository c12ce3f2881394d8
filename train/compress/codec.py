"""Compressed tensors as raw bytes: blockwise int8/int4 (pipeline) and sparse low-bit (DP).

Pure functions on tensors, run where the tensor is: a GPU stage encodes on its GPU (the payload
is a tensor there, staged to the host to travel) and decodes a payload uploaded to it; the
arithmetic is elementwise and correctly rounded, so a payload decodes to the same bits on
either device. Every payload is a uint8 tensor (one message payload of the Comm)
made of a 12-byte header, per-block fp16 scales and packed codes. The decoder never reads a
length from the payload: it takes the shape (or element count) the plan gives and the run's
`CompressionConfig`, computes the exact payload size, and refuses (raising only `CodecError`)
a payload of another length, another method or version, a non-finite or out-of-range scale,
a code the encoder never produces, or (sparse) a malformed index set.

Scales are two-level so that tiny activation gradients keep their precision: one fp32
maximum per payload and one fp16 ratio in [0, 1] per block (block max / payload max, rounded
up so that no element needs clamping). A block whose max is below 6e-5 of the payload's max
has a subnormal ratio and a coarser step than it needs; below 6e-8 of it, the block is zero.
A block's quantization step is computed from those two stored numbers on both sides, so
quantize-dequantize is deterministic and the decoder reproduces the encoder's values exactly.

Pipeline payload (`encode_dense` / `decode_dense`), blocks of B elements (a power of two):

    b"dq", version, method (1 int8, 2 int4), flags (1: Hadamard), log2 B, 0, 0, fp32 max
    fp16 ratio per block;  codes: int8 in [-127, 127], or int4 in [-7, 7] stored +8, two per byte

With the Hadamard flag each block is rotated by the unnormalised Walsh-Hadamard transform
before quantization (additions and subtractions only, so the same bits everywhere) and by the
same transform divided by B (an exact power of two) after; an outlier's energy spreads over its
block, so the other elements are not all rounded to zero.

Sparse payload (`encode_sparse` / `decode_sparse`) over m candidates in chunks of C, k sent per chunk:

    b"ds", version, value bits (2, 4, 8), index format (0 bitmap, 1 uint16, 2 none), log2 C, 0, 0, fp32 max
    fp16 ratio per chunk;  codes (mid-rise: level c means (c - (2^b - 1)/2) steps), packed;
    indices: a C-bit map per chunk with exactly k bits set, or k ascending uint16 per chunk,
    or nothing when k = C (every element is sent: dense low-bit quantization)

The index format is the smaller of the two for (C, k): a bitmap costs C bits per chunk, a list
16 k bits.
"""

from __future__ import annotations

import math
import struct

import torch

from ..codec import CodecError

__all__ = [
    "CodecError", "dense_payload_bytes", "decode_dense", "decode_sparse", "encode_dense", "encode_sparse",
    "hadamard", "sparse_payload_bytes",
]

_VERSION = 1
_HEADER = 12
_DENSE_BITS = {"int8": 8, "int4": 4}
_DENSE_CODE = {"int8": 1, "int4": 2}


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform of each row of `x` (rows, B), B a power of
    two: H x, where H H = B I. Only additions and subtractions: deterministic on any device."""
    rows, b = x.shape
    if b & (b - 1):
        raise ValueError(f"block size {b} is not a power of two")
    # Each butterfly level writes its sums and differences straight into the other of two
    # buffers (x is only read): the same operations in the same order as a stack of the two
    # halves, bit for bit, with no temporaries (1.4-2.1x faster on one CPU thread).
    src, h = x, 1
    bufs = [torch.empty_like(x), torch.empty_like(x)]
    while h < b:
        dst = bufs[0]
        y = src.reshape(rows, b // (2 * h), 2, h)
        o = dst.view(rows, b // (2 * h), 2, h)
        torch.add(y[:, :, 0, :], y[:, :, 1, :], out=o[:, :, 0, :])
        torch.sub(y[:, :, 0, :], y[:, :, 1, :], out=o[:, :, 1, :])
        src, h = dst, 2 * h
        bufs.reverse()
    return src


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes below 2**bits, `8 // bits` per byte, the first in the low bits (in uint8, one
    shift and OR per code: 3x faster than through int32 for int4)."""
    per = 8 // bits
    if per == 1:
        return codes
    n = codes.numel()
    pad = (-n) % per
    if pad:
        codes = torch.cat((codes, codes.new_zeros(pad)))
    c = codes.reshape(-1, per)
    out = c[:, 0].clone()
    for i in range(1, per):
        out |= c[:, i] << (i * bits)
    return out


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first `n` codes `_pack` packed (in uint8: 4x faster than through int32 for int4)."""
    per = 8 // bits
    if per == 1:
        return packed[:n]
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (i * bits)) & mask for i in range(per)], dim=1).reshape(-1)[:n]


def _header(magic: bytes, a: int, b: int, log2: int, gmax: float, device: torch.device) -> torch.Tensor:
    raw = bytearray(magic + bytes((_VERSION, a, b, log2, 0, 0)) + struct.pack("<f", gmax))
    return torch.frombuffer(raw, dtype=torch.uint8).to(device)


def _as_bytes(payload: object) -> torch.Tensor:
    """The payload as a 1-D uint8 tensor, where it is (a tensor on a GPU is decoded there)."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise CodecError(f"a compressed payload is a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
        return payload
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytearray(payload)
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    raise CodecError(f"a compressed payload is bytes or a uint8 tensor, got {type(payload).__name__}")


def _check_header(buf: torch.Tensor, magic: bytes, a: int, b: int, log2: int, what: str) -> float:
    want = magic + bytes((_VERSION, a, b, log2, 0, 0))
    got = bytes(buf[:8].tolist())
    if got != want:
        raise CodecError(f"{what} header {got.hex()} does not match the run's compression ({want.hex()})")
    (gmax,) = struct.unpack("<f", bytes(buf[8:12].tolist()))
    if not math.isfinite(gmax) or gmax < 0:
        raise CodecError(f"{what} payload maximum {gmax!r} is not a finite non-negative number")
    return gmax


def _ratios(buf: torch.Tensor, what: str) -> torch.Tensor:
    rel = buf.clone().view(torch.float16).to(torch.float32)
    if rel.numel() and not bool(((rel >= 0) & (rel <= 1)).all()):  # NaN fails both comparisons
        raise CodecError(f"{what} block scale outside [0, 1] (or not a number)")
    return rel


def _div(t: torch.Tensor, d: float) -> torch.Tensor:
    """`t / d`, correctly rounded on every device: a CUDA kernel divides by a Python number as a
    multiplication by its reciprocal (one more rounding), by a tensor it divides."""
    return t / torch.full((), d, dtype=t.dtype, device=t.device)


def _scales(amax: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(payload max, fp16 ratio per block) for block maxima `amax`."""
    if amax.numel() == 0:
        return 0.0, torch.empty(0, dtype=torch.float16, device=amax.device)
    gmax = float(amax.max())
    if not math.isfinite(gmax):
        raise ValueError("cannot compress a tensor with non-finite values")
    gmax = struct.unpack("<f", struct.pack("<f", gmax))[0]  # exactly what travels
    if gmax == 0:
        return 0.0, torch.zeros_like(amax, dtype=torch.float16)
    ratio = _div(amax, gmax).clamp_(max=1.0)
    rel = ratio.to(torch.float16)
    # rounded up, so no element of a block exceeds the block's largest level: a ratio of 1 stays 1.
    # The next float16 above a non-negative one below 1 is its bit pattern plus one (torch's
    # nextafter has no float16 kernel on every device)
    up = (rel.view(torch.int16) + 1).view(torch.float16)
    return gmax, torch.where(rel.to(torch.float32) < ratio, up, rel)


# ----------------------------------------------------------------------------- pipeline (dense)

def dense_payload_bytes(numel: int, method: str, block: int) -> int:
    """Size of `encode_dense`'s payload for `numel` elements."""
    nb = -(-numel // block)
    return _HEADER + 2 * nb + nb * block * _DENSE_BITS[method] // 8


def _dense_params(method: str, block: int, hadamard_: bool) -> tuple[int, int, int, int]:
    if method not in _DENSE_BITS:
        raise ValueError(f"dense method must be one of {sorted(_DENSE_BITS)}, got {method!r}")
    if block < 2 or block & (block - 1) or block > 1 << 15:
        raise ValueError(f"block size {block} is not a power of two in [2, 32768]")
    bits = _DENSE_BITS[method]
    return bits, (1 << (bits - 1)) - 1, _DENSE_CODE[method], int(hadamard_)


def encode_dense(t: torch.Tensor, method: str, block: int, hadamard_: bool) -> torch.Tensor:
    """`t` (any shape, floating) as a 1-D uint8 payload: blockwise `method` with per-block scales."""
    bits, qmax, code, flags = _dense_params(method, block, hadamard_)
    x = t.detach().to(torch.float32).reshape(-1)
    n = x.numel()
    nb = -(-n // block)
    if nb * block != n:
        x = torch.cat((x, x.new_zeros(nb * block - n)))
    x = x.reshape(nb, block)
    if hadamard_:
        x = hadamard(x)
    gmax, rel = _scales(x.abs().amax(dim=1) if nb else x.new_zeros(0))
    step = _div(rel.to(torch.float32) * gmax, qmax)[:, None]  # (nb, 1)
    q = torch.where(step > 0, x / torch.where(step > 0, step, 1.0), 0.0).round_().clamp_(-qmax, qmax)
    if bits == 8:
        body = q.to(torch.int8).reshape(-1).view(torch.uint8)
    else:
        body = _pack((q + 8).to(torch.uint8).reshape(-1), 4)
    return torch.cat((_header(b"dq", code, flags, block.bit_length() - 1, gmax, x.device),
                      rel.view(torch.uint8), body))


def decode_dense(payload: object, shape: tuple[int, ...], method: str, block: int, hadamard_: bool) -> torch.Tensor:
    """The float32 tensor of `shape` that `encode_dense` encoded; raises only CodecError for a bad payload."""
    bits, qmax, code, flags = _dense_params(method, block, hadamard_)
    n = math.prod(shape)
    expected = dense_payload_bytes(n, method, block)
    buf = _as_bytes(payload)
    if buf.numel() != expected:
        raise CodecError(f"{method} payload for shape {tuple(shape)} must be {expected} bytes, got {buf.numel()}")
    gmax = _check_header(buf, b"dq", code, flags, block.bit_length() - 1, f"{method} activation")
    nb = -(-n // block)
    rel = _ratios(buf[_HEADER:_HEADER + 2 * nb], method)
    body = buf[_HEADER + 2 * nb:]
    if bits == 8:
        q = body.clone().view(torch.int8).to(torch.float32)
        if bool((q < -qmax).any()):
            raise CodecError("int8 code -128 is never produced")
    else:
        c = _unpack(body, 4, nb * block)
        if bool((c == 0).any()):
            raise CodecError("int4 code -8 is never produced")
        q = c.to(torch.float32) - 8
    step = _div(rel * gmax, qmax)
    x = q.reshape(nb, block) * step[:, None]
    if hadamard_:
        x = hadamard(x) / block
    return x.reshape(-1)[:n].reshape(shape)


# ----------------------------------------------------------------------------- DP (sparse)

def _sparse_params(chunk: int, k: int, bits: int) -> tuple[int, int]:
    if chunk < 8 or chunk & (chunk - 1) or chunk > 1 << 16:
        raise ValueError(f"chunk size {chunk} is not a power of two in [8, 65536]")
    if not 1 <= k <= chunk:
        raise ValueError(f"k = {k} values per chunk of {chunk}")
    if bits not in (2, 4, 8):
        raise ValueError(f"value bits must be 2, 4 or 8, got {bits}")
    index_format = 2 if k == chunk else 0 if chunk <= 16 * k else 1
    return index_format, chunk.bit_length() - 1


def sparse_payload_bytes(m: int, chunk: int, k: int, bits: int) -> int:
    """Size of `encode_sparse`'s payload for m candidates."""
    fmt, _ = _sparse_params(chunk, k, bits)
    nch = -(-m // chunk)
    index = (nch * chunk // 8, 2 * nch * k, 0)[fmt]
    return _HEADER + 2 * nch + -(-nch * k * bits // 8) + index


def encode_sparse(x: torch.Tensor, chunk: int, k: int, bits: int) -> torch.Tensor:
    """The k largest-magnitude of every `chunk` consecutive elements of the 1-D `x`, with their
    positions, as a uint8 payload (`bits` per value, one scale per chunk)."""
    fmt, log2 = _sparse_params(chunk, k, bits)
    x = x.detach().to(torch.float32).reshape(-1)
    m = x.numel()
    nch = -(-m // chunk)
    if nch * chunk != m:
        x = torch.cat((x, x.new_zeros(nch * chunk - m)))
    xc = x.reshape(nch, chunk)
    if k == chunk:
        idx = torch.arange(chunk, dtype=torch.int64, device=x.device).expand(nch, chunk)
    else:
        idx = torch.topk(xc.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values  # (nch, k)
    vals = torch.gather(xc, 1, idx)
    gmax, rel = _scales(vals.abs().amax(dim=1) if nch else vals.new_zeros(0))
    half = ((1 << bits) - 1) / 2
    step = _div(rel.to(torch.float32) * gmax, half)[:, None]
    q = torch.where(step > 0, vals / torch.where(step > 0, step, 1.0), 0.0) + half
    codes = q.round_().clamp_(0, (1 << bits) - 1).to(torch.uint8).reshape(-1)
    if fmt == 2:
        index = torch.empty(0, dtype=torch.uint8, device=x.device)
    elif fmt == 0:
        mask = torch.zeros(nch, chunk, dtype=torch.uint8, device=x.device)
        mask.scatter_(1, idx, 1)
        index = _pack(mask.reshape(-1), 1)
    else:
        flat = idx.reshape(-1)  # < 65536: little-endian uint16
        index = torch.stack(((flat & 0xFF), (flat >> 8)), dim=1).to(torch.uint8).reshape(-1)
    return torch.cat((_header(b"ds", bits, fmt, log2, gmax, x.device), rel.view(torch.uint8),
                      _pack(codes, bits), index))


def decode_sparse(payload: object, m: int, chunk: int, k: int, bits: int) -> torch.Tensor:
    """The dense float32 vector of m elements that `encode_sparse` encoded (zeros where nothing
    was sent); raises only CodecError for a bad payload."""
    fmt, log2 = _sparse_params(chunk, k, bits)
    expected = sparse_payload_bytes(m, chunk, k, bits)
    buf = _as_bytes(payload)
    if buf.numel() != expected:
        raise CodecError(f"sparse payload for {m} elements must be {expected} bytes, got {buf.numel()}")
    gmax = _check_header(buf, b"ds", bits, fmt, log2, "sparse")
    nch = -(-m // chunk)
    off = _HEADER
    rel = _ratios(buf[off:off + 2 * nch], "sparse")
    off += 2 * nch
    nval = -(-nch * k * bits // 8)
    codes = _unpack(buf[off:off + nval], bits, nch * k).to(torch.float32).reshape(nch, k)
    off += nval
    dev = buf.device
    if fmt == 2:
        idx = torch.arange(chunk, dtype=torch.int64, device=dev).expand(nch, chunk)
    elif fmt == 0:
        mask = _unpack(buf[off:], 1, nch * chunk).reshape(nch, chunk)
        if bool((mask.sum(dim=1, dtype=torch.int64) != k).any()):
            raise CodecError(f"sparse index map does not select exactly {k} of each chunk")
        idx = mask.nonzero()[:, 1].reshape(nch, k)  # row-major: ascending within each chunk
    else:
        pairs = buf[off:].to(torch.int64).reshape(-1, 2)
        idx = (pairs[:, 0] | (pairs[:, 1] << 8)).reshape(nch, k)
        if k > 1 and bool((idx[:, 1:] <= idx[:, :-1]).any()):
            raise CodecError("sparse indices are not strictly ascending within a chunk")
        if bool((idx >= chunk).any()):
            raise CodecError(f"sparse index beyond the chunk of {chunk}")
    half = ((1 << bits) - 1) / 2
    step = _div(rel * gmax, half)
    vals = (codes - half) * step[:, None]
    out = torch.zeros(nch * chunk, dtype=torch.float32, device=dev)
    flat = idx + torch.arange(nch, dtype=torch.int64, device=dev)[:, None] * chunk
    out[flat.reshape(-1)] = vals.reshape(-1)
    return out[:m]
