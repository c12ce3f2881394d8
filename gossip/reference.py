"""The reference transformer block a peer's compute figure (`compute_ms`) times, and its timing.

The scheduler turns the figure into the peer's speed by the block's FLOPs (control/compute.py);
a run's own layer is timed against it the same way (`kind_factors`). torch is imported only
when a block is built: importing this module loads neither torch nor trio.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["REFERENCE_BLOCK", "reference_block", "time_block_ms"]

# width, heads, sequence length and batch
REFERENCE_BLOCK = (256, 4, 128, 4)


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
