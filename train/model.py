"""GPT model split into stages: contiguous block ranges, deterministic per-layer initialisation.

A stage holds blocks [start, end) of the model. The first stage (start == 0) also holds the
token and position embeddings; the last (end == n_layer) the final norm, the head and the loss.
One stage covering every block is the whole model. Parameter names carry the global block
index (`h.7.attn.c_attn.weight`), so names agree however the model is split, and each block's
initial weights depend only on (seed, block index): any peer can build any stage.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .spec import GPTSpec

__all__ = ["GPTStage", "init_generator", "assemble", "generate"]


def init_generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator seeded from (seed, key); key names a block ("h.3") or "embed" / "head"."""
    digest = hashlib.sha256(f"dtfm-init/{seed}/{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: GPTSpec):
        super().__init__()
        self.n_head = spec.n_head
        self.c_attn = nn.Linear(spec.n_embd, 3 * spec.n_embd, bias=spec.bias)
        self.c_proj = nn.Linear(spec.n_embd, spec.n_embd, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, spec: GPTSpec):
        super().__init__()
        self.c_fc = nn.Linear(spec.n_embd, spec.mlp_ratio * spec.n_embd, bias=spec.bias)
        self.c_proj = nn.Linear(spec.mlp_ratio * spec.n_embd, spec.n_embd, bias=spec.bias)
        self.approximate = "tanh" if spec.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, spec: GPTSpec):
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.n_embd, bias=spec.bias)
        self.attn = CausalSelfAttention(spec)
        self.ln_2 = nn.LayerNorm(spec.n_embd, bias=spec.bias)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


def _init_(module: nn.Module, gen: torch.Generator, proj_std: float) -> None:
    """nanoGPT's scheme, drawn from `gen` in parameter-name order."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif name.startswith("ln") or ".ln" in name:
                p.fill_(1.0)
            else:
                std = proj_std if name.endswith("c_proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


class GPTStage(nn.Module):
    """Blocks [start, end) of a GPT, with the embeddings on the first and the head on the last."""

    def __init__(self, spec: GPTSpec, layer_range: tuple[int, int], seed: int):
        super().__init__()
        start, end = layer_range
        if not 0 <= start < end <= spec.n_layer:
            raise ValueError(f"layer range {layer_range} is not inside [0, {spec.n_layer})")
        self.spec, self.layer_range = spec, (start, end)
        self.is_first, self.is_last = start == 0, end == spec.n_layer
        proj_std = 0.02 / math.sqrt(2 * spec.n_layer)
        if self.is_first:
            self.wte = nn.Embedding(spec.vocab, spec.n_embd)
            self.wpe = nn.Embedding(spec.seq_len, spec.n_embd)
            gen = init_generator(seed, "embed")
            with torch.no_grad():  # the same draws on any stage holding the (tied) embedding
                self.wte.weight.copy_(torch.randn(self.wte.weight.shape, generator=gen) * 0.02)
                self.wpe.weight.copy_(torch.randn(self.wpe.weight.shape, generator=gen) * 0.02)
        self.h = nn.ModuleDict({str(i): Block(spec) for i in range(start, end)})
        for i in range(start, end):
            _init_(self.h[str(i)], init_generator(seed, f"h.{i}"), proj_std)
        if self.is_last:
            self.ln_f = nn.LayerNorm(spec.n_embd, bias=spec.bias)
            if spec.tied_head:
                if not self.is_first:  # a copy of the embedding, kept equal by the gradient sync
                    self.wte = nn.Embedding(spec.vocab, spec.n_embd)
                    gen = init_generator(seed, "embed")
                    with torch.no_grad():
                        self.wte.weight.copy_(torch.randn(self.wte.weight.shape, generator=gen) * 0.02)
            else:
                self.lm_head = nn.Linear(spec.n_embd, spec.vocab, bias=False)
                with torch.no_grad():
                    gen = init_generator(seed, "head")
                    self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=gen) * 0.02)

    @property
    def holds_tied_copy(self) -> bool:
        """True on a last stage that keeps its own copy of the tied embedding."""
        return self.spec.tied_head and self.is_last and not self.is_first

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """x: tokens (B, T) on the first stage, hidden states (B, T, C) elsewhere.

        Returns hidden states (B, T, C), or on the last stage the logits (B, T, V), or with
        `targets` (B, T) the mean cross-entropy loss.
        """
        if self.is_first:
            t = x.shape[1]
            if t > self.spec.seq_len:
                raise ValueError(f"sequence of {t} tokens exceeds seq_len {self.spec.seq_len}")
            pos = torch.arange(t, device=x.device)
            x = self.wte(x) + self.wpe(pos)  # (B, T, C)
        for block in self.h.values():
            x = block(x)
        if not self.is_last:
            return x
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight) if self.spec.tied_head else self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def assemble(spec: GPTSpec, stages: list["GPTStage"], seed: int = 0) -> "GPTStage":
    """The whole model from stages that together cover every layer (parameters copied by name)."""
    whole = GPTStage(spec, (0, spec.n_layer), seed)
    have = {n: p for st in stages for n, p in st.named_parameters()}
    missing = [n for n, _ in whole.named_parameters() if n not in have]
    if missing:
        raise ValueError(f"stages do not cover the model: missing {missing[:3]}")
    with torch.no_grad():
        for n, p in whole.named_parameters():
            p.copy_(have[n])
    return whole


@torch.no_grad()
def generate(model: "GPTStage", prompt: torch.Tensor, new_tokens: int, temperature: float = 1.0,
             generator: torch.Generator | None = None, top_k: int | None = None) -> torch.Tensor:
    """Sample `new_tokens` after `prompt` (T,) int64 from a whole model; returns (T + new_tokens,).

    temperature <= 0 takes the most likely token; `top_k` keeps only the k likeliest tokens."""
    if not (model.is_first and model.is_last):
        raise ValueError("generation needs the whole model (see assemble)")
    if prompt.numel() < 1:
        raise ValueError("generation needs a prompt of at least one token")
    dev = next(model.parameters()).device
    seq = prompt.to(dev).reshape(1, -1)
    for _ in range(new_tokens):
        logits = model(seq[:, -model.spec.seq_len:])[0, -1].float()  # (V,)
        if temperature <= 0:
            nxt = logits.argmax().reshape(1)
        else:
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits / temperature, dim=-1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator).to(dev)
        seq = torch.cat([seq, nxt.reshape(1, 1)], dim=1)
    return seq[0]
