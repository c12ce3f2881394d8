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
existed. On a CPU torch autocasts to bfloat16 too (slower there than float32 on most CPUs;
useful to test the path without a GPU).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["autocast"]


def autocast(precision: str, device: torch.device | str) -> AbstractContextManager:
    """The context a forward pass of `precision` runs under on `device` (nullcontext for fp32)."""
    if precision == "fp32":
        return nullcontext()
    if precision != "bf16":
        raise ValueError(f"unknown precision {precision!r}")
    kind = torch.device(device).type
    return torch.autocast(device_type=kind, dtype=torch.bfloat16)
