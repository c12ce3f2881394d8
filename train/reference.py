"""Single-process training of the whole model on the whole global batch: the oracle that
pipeline and data-parallel training must reproduce."""

from __future__ import annotations

import torch

from .data import Corpus
from .optim import clip_coefficient
from .precision import autocast
from .spec import GPTSpec, TrainConfig
from .worker import StageState

__all__ = ["reference_state", "reference_step"]


def reference_state(spec: GPTSpec, cfg: TrainConfig) -> StageState:
    """The whole model (one stage of every layer) with a fresh optimizer."""
    return StageState(spec, cfg, (0, spec.n_layer))


def reference_step(state: StageState, corpus: Corpus) -> float:
    """One plain step: forward the global batch, backward, clip, AdamW. Returns the loss."""
    cfg, spec = state.cfg, state.spec
    if state.layer_range != (0, spec.n_layer):
        raise ValueError("the reference trains the whole model")
    x, y = corpus.batch(cfg.seed, state.step, range(cfg.global_batch_seqs), spec.seq_len)
    for p in state.params.values():
        p.grad = None
    with autocast(cfg.precision, state.device):
        loss = state.module(x.to(state.device), y.to(state.device))
    loss.backward()
    sq = sum(float(p.grad.double().pow(2).sum()) for p in state.params.values() if p.grad is not None)
    coef = clip_coefficient(sq, cfg.grad_clip_norm)
    if coef < 1.0:
        with torch.no_grad():
            for p in state.params.values():
                if p.grad is not None:
                    p.grad.mul_(coef)
    state.last_grad_norm = sq ** 0.5
    state.optim.step(cfg.lr_at(state.step))
    state.step += 1
    return float(loss.detach())
