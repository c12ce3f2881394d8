"""Model and training configuration: frozen dataclasses with named presets.

`GPTSpec` is the model's shape; `TrainConfig` the optimisation and pipeline settings of a run.
Both travel inside checkpoints (as JSON via `to_dict`) so a checkpoint says what made it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

from dtfm.fromdict import from_dict

__all__ = ["ACTIVATIONS", "GPTSpec", "TrainConfig", "PRESETS", "PRECISIONS", "get_preset", "WIRE_DTYPES"]

# Dtypes activations and their gradients may travel in between stages.
WIRE_DTYPES = ("float32", "float16", "bfloat16")

# How a stage computes: "fp32" throughout, or "bf16" mixed precision (fp32 master weights, gradients
# and AdamW moments; matrix products under bfloat16 autocast; see train/precision.py).
PRECISIONS = ("fp32", "bf16")

# The MLP's GELU: "gelu" is the exact (erf) form, "gelu_tanh" the tanh approximation that
# OpenAI's GPT-2 checkpoints were trained with (Hugging Face's "gelu_new").
ACTIVATIONS = ("gelu", "gelu_tanh")


@dataclass(frozen=True)
class GPTSpec:
    """A GPT-style decoder: embeddings, `n_layer` pre-norm blocks, final norm, head."""

    name: str
    n_layer: int  # transformer blocks; the unit the stages split
    n_embd: int  # hidden width; activation bytes per token crossing a stage boundary scale with it
    n_head: int  # attention heads; must divide n_embd
    seq_len: int  # tokens per sequence (context length)
    vocab: int = 256  # 256 for the byte tokenizer
    tied_head: bool = False  # share the token embedding with the head (first and last stage sync it)
    mlp_ratio: int = 4  # MLP hidden width / n_embd
    # Biases in linear layers and norms. Off by default (nanoGPT: a little better and faster);
    # the attention key bias would otherwise get a gradient that is zero but for rounding.
    bias: bool = False
    activation: str = "gelu"  # one of ACTIVATIONS; a model imported from GPT-2 keeps its own

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "seq_len", "vocab", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def layer_params(self) -> int:
        c = self.n_embd
        biases = (7 + self.mlp_ratio) * c if self.bias else 0
        return (4 + 2 * self.mlp_ratio) * c * c + 2 * c + biases

    @property
    def params(self) -> int:
        emb = self.vocab * self.n_embd + self.seq_len * self.n_embd
        head = 0 if self.tied_head else self.vocab * self.n_embd
        return self.n_layer * self.layer_params + emb + head + (2 if self.bias else 1) * self.n_embd

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GPTSpec":
        return from_dict(cls, d, "model spec")


PRESETS: dict[str, GPTSpec] = {
    # Trains on a laptop CPU in minutes.
    "tiny": GPTSpec("tiny", n_layer=4, n_embd=128, n_head=4, seq_len=128),
    # GPT-2-small-like width, byte vocabulary; a CPU can step it, slowly.
    "small": GPTSpec("small", n_layer=12, n_embd=768, n_head=12, seq_len=256),
    # The DT-FM paper's 1.3B shape (24 layers, width 2048, context 2048, GPT-2 vocabulary).
    "gpt3-xl": GPTSpec("gpt3-xl", n_layer=24, n_embd=2048, n_head=16, seq_len=2048, vocab=50257),
}


def get_preset(name: str) -> GPTSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


T = TypeVar("T")


def _opt(default: T, help: str) -> T:
    """A config field whose help text is also the CLI's (see train/cli.py)."""
    return field(default=default, metadata={"help": help})


MAX_WARMUP = 1 << 16  # a `pipeline_warmups` count's bound (a count of micro_batches or more: every forward first)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and pipeline settings of one run; identical on every peer of a swarm."""

    seed: int = _opt(0, "seeds initial weights (with the layer index) and sampling (with the step)")
    global_batch_seqs: int = _opt(16, "sequences per step over all pipelines; fixed for the run")
    micro_batches: int = _opt(4, "micro-batches per pipeline per step: more shrinks the pipeline bubble, "
                                 "fewer amortise per-message cost")
    lr: float = _opt(1e-3, "AdamW peak learning rate")
    warmup_steps: int = _opt(0, "linear warm-up steps up to lr; 0 starts at full lr")
    beta1: float = _opt(0.9, "AdamW first-moment decay")
    beta2: float = _opt(0.95, "AdamW second-moment decay")
    eps: float = _opt(1e-8, "AdamW denominator epsilon")
    weight_decay: float = _opt(0.1, "decoupled weight decay, on matrices only (not norms)")
    grad_clip_norm: float = _opt(1.0, "clip the global L2 gradient norm, over all stages, to this; 0 disables")
    wire_dtype: str = _opt("float32", "dtype of activations and their gradients between stages: "
                                      "float16/bfloat16 halve the bytes, float32 is exact")
    bucket_bytes: int = _opt(4 << 20, "all-reduce bucket size in bytes: smaller overlaps more, "
                                      "larger sends fewer messages")
    comm_timeout_s: float = _opt(60.0, "longest wait for one message before the step fails")
    pipeline_warmups: str = _opt("", "forwards each stage runs before its first backward, one count per stage, "
                                     "comma-separated, none above the one before (then one forward and one "
                                     "backward at a time: 1F1B; a count of micro_batches or more: every "
                                     "forward first); '': every forward first (GPipe)")
    precision: str = _opt("fp32", "fp32: exact (the 1e-5 oracle); bf16: mixed precision, fp32 master weights and "
                                  "AdamW state, bfloat16 matrix products (autocast): faster on a GPU, not bit-exact "
                                  "(docs/train.md has the measured deviation)")

    def __post_init__(self) -> None:
        if self.global_batch_seqs < 1 or self.micro_batches < 1:
            raise ValueError("global_batch_seqs and micro_batches must be positive")
        if not self.lr > 0 or self.warmup_steps < 0:
            raise ValueError("lr must be positive and warmup_steps non-negative")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1) or not self.eps > 0:
            raise ValueError("betas must lie in [0, 1) and eps be positive")
        if self.weight_decay < 0 or self.grad_clip_norm < 0:
            raise ValueError("weight_decay and grad_clip_norm must be non-negative")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.bucket_bytes < 1024 or not self.comm_timeout_s > 0:
            raise ValueError("bucket_bytes must be at least 1024 and comm_timeout_s positive")
        counts = self.warmups() or ()
        if any(not 0 <= v <= MAX_WARMUP for v in counts):
            raise ValueError(f"pipeline_warmups: each count must be in [0, {MAX_WARMUP}], got {self.pipeline_warmups!r:.80}")
        if any(a < b for a, b in zip(counts, counts[1:])):
            raise ValueError("pipeline_warmups: a stage may not warm up with more forwards than the one before it "
                             f"(it would wait for a backward its neighbour runs later), got {self.pipeline_warmups!r:.80}")

    def trains_as(self, other: "TrainConfig") -> bool:
        """Whether a stage trained under `other` may go on under this config: the same but for
        the pipeline schedule, which changes when a link carries what, never the bits."""
        return replace(other, pipeline_warmups=self.pipeline_warmups) == self

    def warmups(self, stages: int | None = None) -> tuple[int, ...] | None:
        """`pipeline_warmups` as counts (None: GPipe); ValueError for a malformed list or one
        that does not name `stages` stages."""
        if not self.pipeline_warmups:
            return None
        try:
            counts = tuple(int(v) for v in self.pipeline_warmups.split(","))
        except ValueError:
            raise ValueError(f"pipeline_warmups must be comma-separated counts, got {self.pipeline_warmups!r:.80}") from None
        if stages is not None and len(counts) != stages:
            raise ValueError(f"pipeline_warmups names {len(counts)} stages, the pipeline has {stages}")
        return counts

    def lr_at(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        return from_dict(cls, d, "train config")


# A profile for unit tests: small batch, fp32 wire, short timeouts so a hung test fails fast.
TEST_CONFIG = TrainConfig(global_batch_seqs=8, micro_batches=4, lr=3e-3, comm_timeout_s=20.0)
