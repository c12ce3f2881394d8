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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

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
    "saved_checkpoints",
    "save_checkpoint",
    "stage_from_tensors",
    "stage_tensors",
    "weight_tensors",
]

FORMAT = "dtfm-stage/1"
WEIGHTS_FORMAT = "dtfm-weights/1"  # parameters only: never a stage to train on
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


def encode_stage(state: StageState) -> tuple[bytes, dict]:
    return _encode(state, stage_tensors(state), FORMAT)


def encode_weights(state: StageState) -> tuple[bytes, dict]:
    """The stage's parameters alone (`param/<name>`, as `encode_stage` has them) and their
    description (format WEIGHTS_FORMAT): no optimizer moments, no compression buffers."""
    return _encode(state, weight_tensors(state), WEIGHTS_FORMAT)


def _encode(state: StageState, named: dict[str, torch.Tensor], fmt: str) -> tuple[bytes, dict]:
    tensors = {k: v.to("cpu").contiguous() for k, v in named.items()}
    blob = st_save(tensors)
    meta = {
        "format": fmt,
        "step": state.step,
        "optim_step": state.optim.step_count,
        "layer_range": list(state.layer_range),
        "spec": state.spec.to_dict(),
        "config": state.cfg.to_dict(),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "bytes": len(blob),
    }
    if not state.compress.config.exact:
        meta["compression"] = state.compress.config.to_dict()
    return blob, meta


def decode_tensors(blob: bytes, meta: dict, formats: tuple[str, ...] = (FORMAT,)) -> dict[str, torch.Tensor]:
    """Check `blob` against `meta`, a description of one of `formats`, and parse it; raises
    CheckpointError only."""
    if not isinstance(meta, dict) or meta.get("format") not in formats:
        raise CheckpointError(f"not a {' or '.join(formats)} description")
    if meta.get("bytes") != len(blob):
        raise CheckpointError(f"blob has {len(blob)} bytes, the description says {meta.get('bytes')!r}")
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise CheckpointError("blob does not match its sha256")
    try:
        return st_load(blob)
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"unreadable safetensors data: {e}") from None


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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # (a full disk: no partial file stays)
        tmp.unlink(missing_ok=True)
        raise


def _stage_dir(root: Path, layer_range: tuple[int, int]) -> Path:
    return root / f"stage-{layer_range[0]:03d}-{layer_range[1]:03d}"


def save_checkpoint(root: str | os.PathLike, state: StageState, keep: int = 3, notes: dict | None = None) -> Path:
    """Write the stage's checkpoint for step `state.step`; keep the newest `keep`. `notes`:
    JSON-able data kept with it (`checkpoint_notes`). Returns the JSON path."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    d = _stage_dir(Path(root), state.layer_range)
    d.mkdir(parents=True, exist_ok=True)
    blob, meta = encode_stage(state)
    if notes is not None:
        meta["notes"] = notes
    base = d / f"step-{state.step:08d}"
    replaced = False
    try:
        _atomic_write(base.with_suffix(".safetensors"), blob)
        replaced = True
        _atomic_write(base.with_suffix(".json"), json.dumps(meta, indent=1).encode())
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
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
            out += [(a, b, int(_STEP_FILE.match(p.name)[1])) for p in list_checkpoints(root, (a, b))]
    return out


def load_checkpoint(path: str | os.PathLike, device: str = "cpu") -> StageState:
    """Load a checkpoint from its JSON path, verifying the hash; raises CheckpointError."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
        blob = path.with_suffix(".safetensors").read_bytes()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    tensors = decode_tensors(blob, meta)
    spec, cfg, rng, step, ostep = _meta_fields(meta)
    return stage_from_tensors(spec, cfg, rng, tensors, step, ostep, device, compression_of(meta))
