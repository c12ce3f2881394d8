"""Mixed precision: the autocast context a stage computes its forward pass under.

`TrainConfig.precision` is "fp32" (everything in float32: the oracle's exact arithmetic) or
"bf16": the parameters, their gradients and the AdamW moments stay float32 (the master
weights), and torch's autocast runs the matrix products (linear layers, attention) in
bfloat16 while it keeps the reductions that need range in float32 (layer norm, softmax inside
the attention kernel, the cross-entropy). The residual stream stays float32: a block adds its
bfloat16 output to a float32 input, which promotes, so what crosses a stage boundary is float32
as in an fp32 run (the wire dtype decides what travels). bfloat16 has float32's exponent range,
so no loss scaling is needed. Backward runs outside the context; autograd replays each
operation in the dtype its forward used.

fp32 enters no context at all, so an fp32 run is bit for bit what it was before precision
existed. On a GPU, float32 means IEEE float32: a stage built on a CUDA device turns TF32 off
for matrix products and cuDNN (`ieee_fp32`), else an fp32 run would not equal one process
that has it off (TF32 keeps 10 mantissa bits: about 1e-3 apart). The setting is torch's and
process-wide; a bf16 run does not use it (its products are bf16 under autocast). On a CPU torch autocasts to bfloat16 too (slower there than float32 on most CPUs;
useful to test the path without a GPU).
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["autocast", "ieee_fp32"]


def autocast(precision: str, device: torch.device | str) -> AbstractContextManager:
    """The context a forward pass of `precision` runs under on `device` (nullcontext for fp32)."""
    if precision == "fp32":
        return nullcontext()
    if precision != "bf16":
        raise ValueError(f"unknown precision {precision!r}")
    kind = torch.device(device).type
    return torch.autocast(device_type=kind, dtype=torch.bfloat16)


def ieee_fp32(device: torch.device | str) -> None:
    """On a CUDA device: float32 matrix products and cuDNN work in IEEE float32, not TF32
    (torch's process-wide switches; a no-op on a CPU)."""
    if torch.device(device).type != "cuda":
        return
    with warnings.catch_warnings():  # (newer torch announces a new API for these switches)
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
