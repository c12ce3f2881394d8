"""A stage of a new layout, built from the tensors of old stages (`assemble_stage`).

When a reconfiguration changes the layer ranges, a peer's new stage takes its blocks from every
old stage that held them, the embeddings from the old first stage and the final norm and head
from the old last; `needed_stages` (control/epoch/source.py) says which old stages a new range
needs, so the peer fetches only those (control/epoch/recovery.py). Parameters and their Adam moments move together, and so
do the compression buffers of a compressed run (`compress/<kind>/<name>`: error-feedback
residual, DiLoCo's anchor and outer momentum), and the stage resumes at the same step and
optimizer step, so training goes on as if it had not been re-split.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import torch

from dtfm.train import (
    CheckpointError,
    CompressionConfig,
    GPTSpec,
    StageState,
    TrainConfig,
    TransferError,
    TransferReceiver,
    compression_of,
    stage_from_tensors,
)

from .recovery import RecoveryError
from .source import needed_stages

__all__ = ["assemble_stage", "needed_stages"]

_BLOCK = re.compile(r"^h\.(\d+)\.")


def _param_name(key: str) -> str:
    """The parameter a tensor belongs to: `param/<name>`, `exp_avg/<name>`, `compress/ef/<name>`
    (parameter names have dots, never slashes)."""
    return key.rsplit("/", 1)[-1]


def _part_tensors(part, spec: GPTSpec, cfg: TrainConfig, step: int, optim_step: int,
                  compression: CompressionConfig) -> dict[str, torch.Tensor]:
    if isinstance(part, dict):
        return part
    m = part.manifest.meta
    try:
        m_spec, m_cfg = GPTSpec.from_dict(m["spec"]), TrainConfig.from_dict(m["config"])
        m_step, m_ostep = int(m["step"]), int(m["optim_step"])
        m_comp = compression_of(m) or CompressionConfig()
    except (KeyError, TypeError, ValueError) as e:  # (CheckpointError is a ValueError)
        raise RecoveryError(f"bad stage description: {e}") from None
    if m_comp != compression:
        raise RecoveryError(f"a part of layers {m.get('layer_range')} was trained with compression "
                            f"{m_comp.describe()!r}, the run uses {compression.describe()!r}")
    # (the micro-batch count may change between epochs of a run whose start left it to the
    # scheduler: it splits each step's batch, the step's gradient stays the global batch's; the
    # pipeline schedule changes with the allocation and never the result)
    if m_spec != spec or not cfg.trains_as(replace(m_cfg, micro_batches=cfg.micro_batches)) or \
            (m_step, m_ostep) != (step, optim_step):
        raise RecoveryError(f"a part of layers {m.get('layer_range')} is of another model, config or step "
                            f"({m_step}, optimizer step {m_ostep}; expected {step}, {optim_step})")
    try:
        return part.tensors()
    except TransferError as e:
        raise RecoveryError(str(e)) from None


def assemble_stage(spec: GPTSpec, cfg: TrainConfig, layer_range: tuple[int, int],
                   parts: Sequence[TransferReceiver | dict[str, torch.Tensor]], step: int, optim_step: int,
                   device: str = "cpu", compression: CompressionConfig | None = None) -> StageState:
    """Stage `layer_range` from the tensors of old stages (`param/<name>`, `exp_avg/<name>`,
    `exp_avg_sq/<name>`, as `TransferReceiver.tensors()` gives them).

    Blocks come from whichever part holds them; `wte`/`wpe` from the old first stage (the part
    with `wpe`); `ln_f` and `lm_head` from the old last stage (the part with `ln_f`); a new last
    stage's tied `wte` copy from the old last stage's copy if it has one, else from the old
    first stage. Moments follow their parameter. Both copies of a tied embedding are equal
    bit for bit (their gradients are summed the same way on both and their updates are
    identical), so either source trains alike. The compression buffers follow their parameter
    too; every part must have been trained with `compression` (None: exact). Raises
    RecoveryError if a tensor is missing."""
    a, b = layer_range
    comp = compression or CompressionConfig()
    tensors = [_part_tensors(p, spec, cfg, step, optim_step, comp) for p in parts]
    first = next((t for t in tensors if "param/wpe.weight" in t), None)
    last = next((t for t in tensors if "param/ln_f.weight" in t), None)
    chosen: dict[str, torch.Tensor] = {}
    for t in tensors:
        for key, v in t.items():
            block = _BLOCK.match(_param_name(key))
            if block is not None and a <= int(block.group(1)) < b:
                chosen.setdefault(key, v)
    if a == 0 and first is not None:
        chosen.update({k: v for k, v in first.items() if _param_name(k).split(".")[0] in ("wte", "wpe")})
    if b == spec.n_layer and last is not None:
        chosen.update({k: v for k, v in last.items() if _param_name(k).split(".")[0] in ("ln_f", "lm_head")})
        if spec.tied_head and a > 0:
            src = last if "param/wte.weight" in last else first
            if src is not None:
                chosen.update({k: v for k, v in src.items() if _param_name(k) == "wte.weight"})
    try:
        return stage_from_tensors(spec, cfg, (a, b), chosen, step, optim_step, device, comp)
    except CheckpointError as e:
        raise RecoveryError(f"cannot assemble layers {[a, b]} at step {step}: {e}") from None
