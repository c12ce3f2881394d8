"""What the scheduler needs to know about the model: communication volumes, compute, memory.

Two kinds of spec produce a `Workload` for a shape (S stages x D pipelines):

- `CommSpec`: the paper's view, two fixed volumes (a stage's gradient, a boundary's activations).
  `PAPER_GPT3_XL` is the preset of the DT-FM authors' scheduler, with their figures as published.
- `ModelSpec`: a GPT-style model from its hyper-parameters; volumes, per-layer compute time and
  per-layer memory follow from it, so the same code schedules the model the swarm really trains.

Units: volumes in the paper's "GB" (transfer seconds = GB * 8 / Gbps), times in seconds,
memory in GiB.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["CommSpec", "ModelSpec", "Workload", "PAPER_GPT3_XL", "PRESETS", "UPDATE_KIND", "get_preset",
           "update_s_per_param"]

# The key of a run layer's figures (`kind`: time per FLOP over the reference's, by micro-batch
# size, sizes from 1) under which its optimizer update is given: FLOP-equivalents per parameter
# at the reference rate (the update's time on a speed-1.0 peer is that over its FLOP/s).
UPDATE_KIND = 0


def update_s_per_param(kind: Mapping[int, float], reference_tflops: float | None) -> float:
    """The update's seconds per parameter on a speed-1.0 peer of `reference_tflops` achieved
    TFLOP/s, from `kind[UPDATE_KIND]`; 0 (not counted) without either."""
    flops = kind.get(UPDATE_KIND, 0.0)
    if reference_tflops is None or not reference_tflops > 0 or not flops > 0:
        return 0.0
    return flops / (reference_tflops * 1e12)


@dataclass(frozen=True)
class Workload:
    """Everything the cost model needs for one shape; built by a spec's `workload()`."""

    stages: int
    dp: int
    layers: int  # transformer layers split over the stages
    grad_gb_total: float  # gradient bytes of all layers together, in GB; a stage holds its share
    act_gb: float  # activations crossing one boundary, one direction, one pipeline, one iteration
    micro_batches: int = 1  # per pipeline per iteration (the GPipe simulator and compute term)
    layer_compute_s: float | None = None  # fwd+bwd of one layer, one micro-batch, speed 1.0; None: off
    layer_memory_gib: float | None = None  # memory one layer needs on its peer; None: memory off
    base_memory_gib: float = 0.0  # memory every stage needs besides its layers (buffers, embeddings)
    act_elem_bytes: int = 2  # bytes of one activation element on an exact wire (sizes compressed payloads)
    grad_elem_bytes: int = 4  # bytes of one gradient element in the exact all-reduce
    head_layers: float = 0.0  # the output head and loss on the last stage, in layers' compute; 0: not counted
    # the optimizer's update (gradient norm, clipping, AdamW) per parameter of a stage, seconds at speed 1.0; 0: not counted
    update_s_per_param: float = 0.0

    def __post_init__(self) -> None:
        if self.stages < 1 or self.dp < 1:
            raise ValueError(f"need at least one stage and one pipeline, got {self.stages} x {self.dp}")
        if self.layers < self.stages:
            raise ValueError(f"{self.layers} layers cannot fill {self.stages} stages")
        if self.grad_gb_total < 0 or self.act_gb < 0 or self.micro_batches < 1:
            raise ValueError("volumes must be non-negative and micro_batches at least 1")
        if self.act_elem_bytes < 1 or self.grad_elem_bytes < 1:
            raise ValueError("element sizes must be at least one byte")
        if not self.update_s_per_param >= 0:
            raise ValueError("the update's time per parameter must be non-negative")

    def compute_layers(self, layers: np.ndarray) -> np.ndarray:
        """Each stage's compute in layers (float): its layers, the last stage's plus the head."""
        out = np.asarray(layers, dtype=float).copy()
        out[-1] += self.head_layers
        return out

    def update_s(self, layers: np.ndarray) -> np.ndarray:
        """Each stage's update at speed 1.0, in seconds: its share of the parameters (as its
        gradient counts them) at `update_s_per_param`."""
        params = self.grad_gb_total * 1e9 / self.grad_elem_bytes * np.asarray(layers, dtype=float) / self.layers
        return params * self.update_s_per_param

    def grad_gb(self, stage_layers: float) -> float:
        """Gradient volume of a stage holding `stage_layers` layers."""
        return self.grad_gb_total * stage_layers / self.layers

    @property
    def uniform_layers(self) -> bool:
        return self.layers % self.stages == 0


@dataclass(frozen=True)
class CommSpec:
    """The paper's model: fixed volumes, compute and memory left out.

    grad_gb_total is the gradient of the whole model; with `layers` layers split evenly, a stage
    holds grad_gb_total / S. act_gb_global is the activation volume of one boundary for the whole
    global batch; a pipeline carries 1/D of it (the global batch stays fixed when D changes).
    """

    name: str
    layers: int
    grad_gb_total: float
    act_gb_global: float
    default_stages: int = 1
    default_dp: int = 1

    def __post_init__(self) -> None:
        if self.layers < 1 or self.grad_gb_total < 0 or self.act_gb_global < 0:
            raise ValueError("layers must be positive and volumes non-negative")

    def workload(self, stages: int, dp: int) -> Workload:
        return Workload(stages, dp, self.layers, self.grad_gb_total, self.act_gb_global / dp)


def _paper_gpt3_xl() -> CommSpec:
    # The authors' figures: 1.3e9 parameters, fp32 gradients, 3 of 24 layers per stage
    # (0.65 GB per stage); activations 2024 x 2048 x 2 B per sequence for 1.25e5 / 2048
    # sequences per pipeline, divided by 2**30 (0.4712 "GB" per boundary and direction at D = 8).
    grad_gb_total = 1.3e9 * 4 / 1e9
    act_gb_pipeline = 2024 * 2048 * 2 * (1.25e5 / 2048) / 2**30
    return CommSpec("gpt3-xl-paper", 24, grad_gb_total, act_gb_pipeline * 8, default_stages=8, default_dp=8)


PAPER_GPT3_XL = _paper_gpt3_xl()


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder; sizes, compute and memory derived from its hyper-parameters."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    micro_batch_size: int  # sequences per micro-batch
    global_batch_seqs: int  # sequences per iteration over all pipelines (fixed for a run)
    act_bytes: int = 2  # bytes per activation element crossing a boundary (fp16/bf16)
    grad_bytes: int = 4  # bytes per gradient element in the DP all-reduce (fp32)
    state_bytes_per_param: int = 16  # weights + gradient + Adam moments, fp32
    reference_tflops: float | None = None  # achieved TFLOP/s of a speed-1.0 peer; None: compute off
    with_memory: bool = False  # include the per-layer memory need (for memory-limited peers)
    head_compute: bool = False  # count the output head's compute on the last stage (with reference_tflops)
    update_s_per_param: float = 0.0  # the optimizer's update per parameter at speed 1.0, seconds (0: not counted)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "micro_batch_size", "global_batch_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")

    @property
    def layer_params(self) -> int:
        h = self.hidden
        return 12 * h * h + 13 * h  # attention (4h^2 + 4h), MLP (8h^2 + 5h), two layer norms (4h)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.seq_len * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params

    def layer_flops(self) -> float:
        """Forward and backward FLOPs of one layer on one micro-batch: 3x the forward, which is
        2 FLOPs per parameter per token plus attention's scores and mixing."""
        tokens = self.micro_batch_size * self.seq_len
        return 3 * (2 * self.layer_params * tokens + 2 * self.micro_batch_size * self.seq_len**2 * self.hidden)

    def micro_batches(self, dp: int) -> int:
        return max(1, math.ceil(self.global_batch_seqs / (dp * self.micro_batch_size)))

    def workload(self, stages: int, dp: int) -> Workload:
        m = self.micro_batches(dp)
        seqs = m * self.micro_batch_size
        act_gb = self.seq_len * self.hidden * self.act_bytes * seqs / 1e9
        # Embeddings are spread over the stages' shares: a stage's gradient is params / S.
        grad_gb_total = self.params * self.grad_bytes / 1e9
        compute = None
        if self.reference_tflops is not None:
            compute = self.layer_flops() / (self.reference_tflops * 1e12)
        head = self.head_layers_equivalent() if self.head_compute and compute is not None else 0.0
        memory = base = None
        if self.with_memory:
            # parameters and optimiser state, plus the activations GPipe keeps for all M micro-batches
            act_per_layer = 16 * self.micro_batch_size * self.seq_len * self.hidden * self.act_bytes * m
            memory = (self.layer_params * self.state_bytes_per_param + act_per_layer) / 2**30
            base = self.embedding_params * self.state_bytes_per_param / 2**30
        return Workload(stages, dp, self.layers, grad_gb_total, act_gb, m, compute, memory, base or 0.0,
                        act_elem_bytes=self.act_bytes, grad_elem_bytes=self.grad_bytes, head_layers=head,
                        update_s_per_param=self.update_s_per_param if compute is not None else 0.0)

    def head_layers_equivalent(self) -> float:
        """The output head's forward and backward (a vocab x hidden matmul per token) in layers'
        compute (a layer: its parameters' matmuls and attention's seq_len x hidden per token)."""
        return self.vocab * self.hidden / (self.layer_params + self.seq_len * self.hidden)


PRESETS: dict[str, CommSpec | ModelSpec] = {
    "gpt3-xl-paper": PAPER_GPT3_XL,
    # GPT-3 XL from its hyper-parameters, 1M tokens per iteration, 40 TFLOP/s achieved per GPU.
    "gpt3-xl": ModelSpec("gpt3-xl", 24, 2048, 16, 2048, 50257, 1, 488, reference_tflops=40.0, with_memory=True),
    # The small model the test swarm trains.
    "gpt-tiny": ModelSpec("gpt-tiny", 8, 256, 4, 128, 4096, 4, 64, reference_tflops=1.0, with_memory=True),
}


def get_preset(name: str) -> CommSpec | ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"no model preset {name!r}: choose one of {', '.join(PRESETS)}") from None
