"""AdamW keyed by parameter name, so a stage's optimizer state is saved, sent and restored by
the same names as its weights; and the global-norm clipping coefficient."""

from __future__ import annotations

import math

import torch

__all__ = ["AdamW", "clip_coefficient"]


class AdamW:
    """Decoupled weight decay Adam (Loshchilov & Hutter), as torch.optim.AdamW computes it.

    Weight decay applies to parameters with two or more dimensions (matrices, embeddings),
    not to biases and norm gains, as in nanoGPT.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], *, betas: tuple[float, float],
                 eps: float, weight_decay: float):
        self.params = params
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.step_count = 0
        self.exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        bc1 = 1 - self.beta1 ** self.step_count
        bc2 = 1 - self.beta2 ** self.step_count
        for name, p in self.params.items():
            g = p.grad
            if g is None:
                continue
            if self.weight_decay and p.dim() >= 2:
                p.mul_(1 - lr * self.weight_decay)
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            m.lerp_(g, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / bc1)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for n in self.params:
            out[f"exp_avg/{n}"] = self.exp_avg[n]
            out[f"exp_avg_sq/{n}"] = self.exp_avg_sq[n]
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor], step_count: int) -> None:
        """Restore moments by name; raises ValueError on a missing name or a wrong shape."""
        for n, p in self.params.items():
            for key, dst in ((f"exp_avg/{n}", self.exp_avg[n]), (f"exp_avg_sq/{n}", self.exp_avg_sq[n])):
                src = tensors.get(key)
                if src is None or src.shape != p.shape:
                    raise ValueError(f"optimizer state {key!r} is missing or has the wrong shape")
                dst.copy_(src)
        if step_count < 0:
            raise ValueError("optimizer step count must be non-negative")
        self.step_count = step_count


def clip_coefficient(total_sq_norm: float, max_norm: float) -> float:
    """The factor gradients are scaled by so their global L2 norm is at most max_norm (0: off)."""
    if max_norm <= 0:
        return 1.0
    norm = math.sqrt(total_sq_norm)
    return min(1.0, max_norm / (norm + 1e-6))
