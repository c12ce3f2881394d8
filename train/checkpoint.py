"""Stage checkpoints: parameters and optimizer state as safetensors plus a JSON description.

`encode_stage` turns a StageState into (blob, meta): the safetensors bytes of every parameter
(`param/<name>`), Adam moment (`exp_avg/<name>`, `exp_avg_sq/<name>`) and compression buffer
(`compress/<kind>/<name>`, with compression on), and a JSON-able dict with the step, the model
spec, the train config, the compression config (when not exact), the layer range and the
sha256 of the blob.
The same pair is what one peer sends another that takes over its stage (`transfer.py`).
`encode_weights` encodes the parameters alone, described as format `WEIGHTS_FORMAT`: what an
export fetches (the model, without the state only a peer that trains the stage on needs).
On disk: `<dir>/stage-<a>-<b>/step-<k>.safetensors` and `.json`, each written to a temporary
file, fsynced and renamed, the JSON last (a checkpoint without its JSON does not exist); a
write that fails (a full disk) leaves nothing of that step behind and raises OSError; the
last `keep` checkpoints of a stage are kept. A checkpoint may carry `notes`: JSON its writer
wants back with the weights (the control plane keeps the step reports of the steps the weights
hold there, so a step's log line survives whoever logged it). Nothing is ever unpickled.

The bytes are safetensors' own (the same header and order as `safetensors.torch.save`, tested),
made here so that no step holds more than one extra copy of a stage: `encode_stage` copies each
tensor once into a buffer of the blob's size (safetensors' `save` copies every tensor to bytes
and then all of them again into its result), `save_checkpoint` writes each tensor's bytes to the
file straight from the tensor, hashing as it goes (no blob at all), and `decode_tensors` makes
the tensors views of a writable blob (a received or read buffer) instead of copies of it. The
header is parsed here too, as untrusted input (`parse_safetensors`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from dtfm.files import atomic_write, fsync_dir

from .compress import CompressionConfig
from .spec import GPTSpec, TrainConfig
from .worker import StageState

__all__ = [
    "FORMAT",
    "WEIGHTS_FORMAT",
    "CheckpointError",
    "decode_tensors",
    "encode_stage",
    "encode_weights",
    "checkpoint_at",
    "checkpoint_notes",
    "compression_of",
    "list_checkpoints",
    "load_checkpoint",
    "parse_safetensors",
    "saved_checkpoints",
    "save_checkpoint",
    "stage_from_tensors",
    "stage_tensors",
    "weight_tensors",
]

FORMAT = "dtfm-stage/1"
WEIGHTS_FORMAT = "dtfm-weights/1"  # parameters only: never a stage to train on
# safetensors' dtype names, and their rank in its order of tensors (descending rank, then name)
_ST_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.bool: ("BOOL", 0), torch.uint8: ("U8", 1), torch.int8: ("I8", 2), torch.int16: ("I16", 3),
    torch.float16: ("F16", 4), torch.bfloat16: ("BF16", 5), torch.int32: ("I32", 6), torch.float32: ("F32", 7),
    torch.float64: ("F64", 8), torch.int64: ("I64", 9)}
_ST_NAMES = {name: dt for dt, (name, _) in _ST_DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a header
_STEP_FILE = re.compile(r"^step-(\d{8})\.json$")
_STAGE_DIR = re.compile(r"^stage-(\d{3,})-(\d{3,})$")


class CheckpointError(ValueError):
    """A checkpoint or transferred stage is malformed, inconsistent or fails its hash."""


def weight_tensors(state: StageState) -> dict[str, torch.Tensor]:
    """The stage's parameters as a checkpoint names them (`param/<name>`), detached, where they
    live (not copied): the model, without what only training it on needs."""
    return {f"param/{n}": p.detach() for n, p in state.params.items()}


def stage_tensors(state: StageState) -> dict[str, torch.Tensor]:
    """The stage's named tensors as a checkpoint holds them: `weight_tensors`, the Adam moments
    (`exp_avg/<name>`, `exp_avg_sq/<name>`) and the compression buffers (`compress/<kind>/<name>`),
    detached, where they live (not copied)."""
    tensors = weight_tensors(state)
    tensors.update(state.optim.state_tensors())
    tensors.update(state.compress.state_tensors())
    return tensors


def encode_stage(state: StageState) -> tuple[memoryview, dict]:
    return _encode(state, stage_tensors(state), FORMAT)


def encode_weights(state: StageState) -> tuple[memoryview, dict]:
    """The stage's parameters alone (`param/<name>`, as `encode_stage` has them) and their
    description (format WEIGHTS_FORMAT): no optimizer moments, no compression buffers."""
    return _encode(state, weight_tensors(state), WEIGHTS_FORMAT)


def _layout(named: dict[str, torch.Tensor]) -> tuple[bytes, list[tuple[str, torch.Tensor]], int]:
    """safetensors' layout of `named`: the header (its length and JSON, padded with spaces to 8
    bytes), the tensors in their order in the file, and the size of the data after the header."""
    items = sorted(named.items(), key=lambda kv: (-_ST_DTYPES[kv[1].dtype][1], kv[0]))
    header, offset = {}, 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, items, offset


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of `t` as a CPU, contiguous tensor holds them (a view when `t` is one already)."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data


def _describe(state: StageState, fmt: str, sha256: str, nbytes: int) -> dict:
    meta = {
        "format": fmt,
        "step": state.step,
        "optim_step": state.optim.step_count,
        "layer_range": list(state.layer_range),
        "spec": state.spec.to_dict(),
        "config": state.cfg.to_dict(),
        "sha256": sha256,
        "bytes": nbytes,
    }
    if not state.compress.config.exact:
        meta["compression"] = state.compress.config.to_dict()
    return meta


def _encode(state: StageState, named: dict[str, torch.Tensor], fmt: str) -> tuple[memoryview, dict]:
    """The blob (read-only, one buffer of its size: each tensor copied into it once) and its description."""
    header, items, data_bytes = _layout(named)
    buf = np.empty(len(header) + data_bytes, dtype=np.uint8)
    buf[:len(header)] = np.frombuffer(header, dtype=np.uint8)
    at = len(header)
    for _, t in items:
        raw = _bytes_of(t)
        buf[at:at + raw.nbytes] = np.frombuffer(raw, dtype=np.uint8)
        at += raw.nbytes
    blob = buf.data.toreadonly()
    return blob, _describe(state, fmt, hashlib.sha256(blob).hexdigest(), blob.nbytes)


def parse_safetensors(blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes, checked as untrusted input (the header's size, JSON,
    dtypes, shapes, and offsets that tile the data exactly); raises CheckpointError only. A
    tensor is a view of `blob` when `blob` is writable and the tensor's offset is aligned to its
    item size (then it shares, and keeps alive, `blob`'s memory), else a copy."""
    view = memoryview(blob).cast("B")
    if view.nbytes < 8:
        raise CheckpointError("safetensors data shorter than its header length")
    (n,) = struct.unpack("<Q", view[:8])
    if n > MAX_HEADER_BYTES or 8 + n > view.nbytes:
        raise CheckpointError(f"safetensors header of {n} bytes does not fit the data")
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError("safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError("safetensors header is not a JSON object")
    data = view[8 + n:]
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"safetensors entry {name!r} must have dtype, shape and data_offsets")
        dtype = _ST_NAMES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise CheckpointError(f"safetensors entry {name!r}: unknown dtype {info['dtype']!r}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError(f"safetensors entry {name!r}: bad shape")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data.nbytes):
            raise CheckpointError(f"safetensors entry {name!r}: bad data offsets")
        if offsets[1] - offsets[0] != int(np.prod(shape, dtype=object)) * dtype.itemsize:
            raise CheckpointError(f"safetensors entry {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape}")
        entries.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    entries.sort()
    end = 0
    for a, b, name, _, _ in entries:
        if a != end:
            raise CheckpointError(f"safetensors entry {name!r} does not start where the one before it ends")
        end = b
    if end != data.nbytes:
        raise CheckpointError("safetensors data does not end where its last tensor does")
    out = {}
    for a, b, name, dtype, shape in entries:
        if b == a:
            out[name] = torch.empty(shape, dtype=dtype)
        elif view.readonly or (8 + n + a) % dtype.itemsize:
            out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=dtype).reshape(shape)
        else:
            out[name] = torch.frombuffer(data, dtype=dtype, offset=a, count=(b - a) // dtype.itemsize).reshape(shape)
    return out


def decode_tensors(blob: bytes | bytearray | memoryview, meta: dict,
                   formats: tuple[str, ...] = (FORMAT,)) -> dict[str, torch.Tensor]:
    """Check `blob` against `meta`, a description of one of `formats`, and parse it; raises
    CheckpointError only. The tensors are views of a writable `blob` (`parse_safetensors`)."""
    if not isinstance(meta, dict) or meta.get("format") not in formats:
        raise CheckpointError(f"not a {' or '.join(formats)} description")
    nbytes = memoryview(blob).nbytes
    if meta.get("bytes") != nbytes:
        raise CheckpointError(f"blob has {nbytes} bytes, the description says {meta.get('bytes')!r}")
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise CheckpointError("blob does not match its sha256")
    return parse_safetensors(blob)


def _meta_fields(meta: dict) -> tuple[GPTSpec, TrainConfig, tuple[int, int], int, int]:
    try:
        spec = GPTSpec.from_dict(meta["spec"])
        cfg = TrainConfig.from_dict(meta["config"])
        a, b = (int(x) for x in meta["layer_range"])
        step, ostep = int(meta["step"]), int(meta["optim_step"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"bad checkpoint description: {e}") from None
    if step < 0 or ostep < 0:
        raise CheckpointError("negative step in checkpoint description")
    return spec, cfg, (a, b), step, ostep


def compression_of(meta: dict) -> CompressionConfig | None:
    """The compression config a checkpoint description carries (None: exact); CheckpointError if malformed."""
    raw = meta.get("compression")
    if raw is None:
        return None
    try:
        if not isinstance(raw, dict):
            raise TypeError("not a map")
        return CompressionConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"bad compression config in checkpoint description: {e}") from None


def stage_from_tensors(spec: GPTSpec, cfg: TrainConfig, layer_range: tuple[int, int],
                       tensors: dict[str, torch.Tensor], step: int, optim_step: int,
                       device: str = "cpu", compression: CompressionConfig | None = None) -> StageState:
    """Build a stage from named tensors (of one or several sources); every name must be present,
    the compression buffers too when `compression` is not exact."""
    try:
        state = StageState(spec, cfg, layer_range, device, compression)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    with torch.no_grad():
        for n, p in state.params.items():
            src = tensors.get(f"param/{n}")
            if src is None or src.shape != p.shape or src.dtype != p.dtype:
                raise CheckpointError(f"parameter {n!r} is missing or has the wrong shape or dtype")
            p.copy_(src)
        try:
            state.optim.load_state_tensors(tensors, optim_step)
            state.compress.load_state_tensors(tensors)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    state.step = step
    return state


def _write_hashed(path: Path, parts: Iterable[bytes | memoryview]) -> str:
    """Replace `path` with `parts` written in turn, each made when it is written (`atomic_write`:
    on a full disk no partial file stays); the sha256 of what was written."""
    h = hashlib.sha256()

    def hashed() -> Iterator[bytes | memoryview]:
        for part in parts:
            h.update(part)
            yield part

    atomic_write(path, hashed())
    return h.hexdigest()


def _stage_dir(root: Path, layer_range: tuple[int, int]) -> Path:
    return root / f"stage-{layer_range[0]:03d}-{layer_range[1]:03d}"


def save_checkpoint(root: str | os.PathLike, state: StageState, keep: int = 3, notes: dict | None = None) -> Path:
    """Write the stage's checkpoint for step `state.step`; keep the newest `keep`. `notes`:
    JSON-able data kept with it (`checkpoint_notes`). Returns the JSON path."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    d = _stage_dir(Path(root), state.layer_range)
    d.mkdir(parents=True, exist_ok=True)
    header, items, data_bytes = _layout(stage_tensors(state))
    base = d / f"step-{state.step:08d}"
    replaced = False
    try:
        # each tensor's bytes go to the file from the tensor itself (from a CPU copy of one tensor
        # at a time on a GPU): no blob of the whole stage is ever made
        sha = _write_hashed(base.with_suffix(".safetensors"),
                            itertools.chain([header], (_bytes_of(t) for _, t in items)))
        replaced = True
        meta = _describe(state, FORMAT, sha, len(header) + data_bytes)
        if notes is not None:
            meta["notes"] = notes
        atomic_write(base.with_suffix(".json"), json.dumps(meta, indent=1).encode())
        fsync_dir(d)
    except OSError:
        # A write the disk refused (full, read-only): once the weights were replaced, this step's
        # checkpoint goes altogether, rather than weights beside another write's description;
        # every other checkpoint stays as it was.
        if replaced:
            base.with_suffix(".json").unlink(missing_ok=True)
            base.with_suffix(".safetensors").unlink(missing_ok=True)
        raise
    for old in list_checkpoints(root, state.layer_range)[:-keep]:
        old.unlink(missing_ok=True)
        old.with_suffix(".safetensors").unlink(missing_ok=True)
    return base.with_suffix(".json")


def checkpoint_notes(path: str | os.PathLike) -> dict:
    """The notes saved with the checkpoint whose JSON is at `path` ({} when it has none); raises
    CheckpointError when the JSON cannot be read."""
    try:
        meta = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    notes = meta.get("notes") if isinstance(meta, dict) else None
    return notes if isinstance(notes, dict) else {}


def list_checkpoints(root: str | os.PathLike, layer_range: tuple[int, int]) -> list[Path]:
    """JSON paths of the stage's checkpoints, oldest first."""
    d = _stage_dir(Path(root), layer_range)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _STEP_FILE.match(p.name))


def checkpoint_at(root: str | os.PathLike, layer_range: tuple[int, int], step: int) -> Path | None:
    """The JSON path of the stage's checkpoint of `step`, if there is one."""
    path = _stage_dir(Path(root), layer_range) / f"step-{step:08d}.json"
    return path if path.is_file() else None


def saved_checkpoints(root: str | os.PathLike) -> list[tuple[int, int, int]]:
    """(first layer, end layer, step) of every checkpoint under `root`: stages in folder order,
    each stage's steps oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        m = _STAGE_DIR.match(d.name)
        if m and d.is_dir():
            a, b = int(m[1]), int(m[2])
            for p in list_checkpoints(root, (a, b)):
                s = _STEP_FILE.match(p.name)
                if s:
                    out.append((a, b, int(s[1])))
    return out


def load_checkpoint(path: str | os.PathLike, device: str = "cpu") -> StageState:
    """Load a checkpoint from its JSON path, verifying the hash; raises CheckpointError."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
        blob = _read_file(path.with_suffix(".safetensors"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    tensors = decode_tensors(blob, meta)
    spec, cfg, rng, step, ostep = _meta_fields(meta)
    return stage_from_tensors(spec, cfg, rng, tensors, step, ostep, device, compression_of(meta))


def _read_file(path: Path) -> memoryview:
    """The file's bytes in one writable buffer of its size (the tensors become views of it)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = np.empty(size, dtype=np.uint8).data
        got = 0
        while got < size:
            n = f.readinto(buf[got:])
            if not n:
                raise OSError(f"{path} ended after {got} of {size} bytes")
            got += n
    return buf
