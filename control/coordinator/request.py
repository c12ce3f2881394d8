"""What an operator's `train start` asks for (`TrainRequest`, read and checked from the
arguments of the operator's signed start, control/operator.py) and the error a train operation
answers with (`TrainError`, its message meant for the operator). A request names its data set by
the sha256 of its tokens (and a name for messages), never by a path: every peer trains on the
data it was started with (`dtfm-peer join --data`). The operations are in docs/control.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dtfm.sched import MAX_MICRO_BATCHES, micro_batch_options
from dtfm.train import PRESETS, CompressionConfig, GPTSpec, TrainConfig, parse_compression

if TYPE_CHECKING:  # (dtfm.train's Corpus loads torch: `dtfm-peer status` must not)
    from dtfm.train import Corpus

__all__ = ["AUTO", "HF_PRESET_PREFIX", "KNOBS", "PLACEMENTS", "TrainError", "TrainRequest", "hf_preset"]

# How the issuer places peers: the DT-FM scheduler, or a uniformly random allocation of the same
# shape (the baseline the scheduler is measured against).
PLACEMENTS = ("scheduler", "random")

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_DATA_NAME_LEN = 256

# The training knobs a start may set (TrainConfig fields, with their checks): each is in the
# signed arguments only where it differs from TrainConfig's default, so a start that sets none
# signs the same bytes as before the knobs existed. The seed is its own argument. micro_batches
# may also be AUTO: the scheduler chooses it with the shape (`TrainRequest.auto_micro_batches`).
AUTO = "auto"
KNOBS: dict[str, type] = {"lr": float, "warmup_steps": int, "global_batch_seqs": int, "micro_batches": int,
                          "wire_dtype": str, "weight_decay": float, "grad_clip_norm": float, "precision": str}

# A run started from a Hugging Face folder (`train start --init-from DIR`) names its model by the
# folder's digest (train/hf.py `hf_digest`): its preset name is this prefix and the digest's first
# 16 hex digits; the signed start carries the whole digest. Every peer must hold the same folder
# (`dtfm-peer join --model-dir DIR`).
HF_PRESET_PREFIX = "hf-"


def hf_preset(digest: str) -> str:
    """The preset name of the model in the folder of sha256 `digest`."""
    return HF_PRESET_PREFIX + digest[:16]


# Each stage is checkpointed every this many steps unless the operator says otherwise
# (`--checkpoint-every K`; 0: only where the run ends). A crash then costs at most this many
# steps of work, and the write (parameters and Adam state, 12 bytes a parameter, to local disk)
# stays about 1% of the step time from the tiny preset (a few MB, steps of 0.1-0.5 s) to a
# gpt3-xl stage (GBs, steps of tens of seconds). The end of a run is checkpointed whatever K is.
DEFAULT_CHECKPOINT_EVERY = 20


_A = {int: "an integer", float: "a number", str: "a string"}


class TrainError(Exception):
    """A `train start` / `train stop` that cannot be done, with the reason for the operator.
    `deposed`: an election replaced the coordinator that had the operation before it was done,
    so nothing was done; the operator may sign it again (a signed operation is taken once)."""

    def __init__(self, reason: str, *, deposed: bool = False) -> None:
        super().__init__(reason)
        self.deposed = deposed


def _digest_arg(args: dict, key: str, what: str) -> str | None:
    """args[key]: absent, or 64 lowercase hex digits (`what` says of what); TrainError otherwise."""
    v = args.get(key)
    if v is not None and (type(v) is not str or not _SHA256_HEX.fullmatch(v)):
        raise TrainError(f"{key} must be 64 lowercase hex digits ({what})")
    return v


def _name_arg(args: dict, key: str) -> str:
    """args[key]: a display name of at most MAX_DATA_NAME_LEN characters ("" when absent)."""
    v = args.get(key, "")
    if type(v) is not str or len(v) > MAX_DATA_NAME_LEN:
        raise TrainError(f"{key} must be a string of at most {MAX_DATA_NAME_LEN} characters")
    return v


@dataclass(frozen=True)
class TrainRequest:
    """What `dtfm-peer train start` asks for."""

    preset: str = "tiny"
    steps: int = 100
    seed: int = 0
    stages: int | None = None  # None: the scheduler picks the shape
    dp: int | None = None
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY  # 0: only where the run ends
    data_hash: str | None = None  # sha256 hex of the data set's tokens (`Corpus.fingerprint`)
    data_name: str = ""  # what the data set is called, for messages
    train: TrainConfig | None = None  # None: TrainConfig() with this seed
    placement: str = "scheduler"  # or "random": a random allocation of the given shape (a baseline)
    min_peers: int = 1  # the first configuration forms once this many peers are live and measured
    wait_s: float = 0.0  # how long to wait for them before giving up
    # How the run compresses each axis (docs/compression.md); exact by default, and then the
    # signed arguments carry no "compress" key (an exact start signs the same bytes as before).
    compression: CompressionConfig = CompressionConfig()
    # The sha256 (`hf_digest`) of the Hugging Face GPT-2 folder the run starts from, and what
    # it is called, for messages; None: fresh weights of the preset.
    init_from: str | None = None
    init_name: str = ""
    # The scheduler chooses the micro-batch count with the shape (`--micro-batches auto`): the
    # allocation carries its choice (`micro_batches_allowed`), and `config.micro_batches` is only
    # where the search starts. False: the config's, exactly, for the whole run.
    auto_micro_batches: bool = False

    def __post_init__(self) -> None:
        if self.train is not None and self.train.seed != self.seed:
            raise TrainError(f"the training config's seed {self.train.seed} is not the request's {self.seed}")

    def micro_batches_allowed(self, micro_batches: int, dp: int) -> bool:
        """Whether an allocation of `dp` pipelines may run `micro_batches` per pipeline for this
        start: the config's exactly, or with `auto_micro_batches` a count within the scheduler's
        bound (`dtfm.sched.MAX_MICRO_BATCHES`) that gives every micro-batch of every pipeline a
        sequence. The scheduler chooses a divisor of the per-pipeline batch
        (`dtfm.sched.micro_batch_options`), or at a reconfiguration may keep the run's count
        with a D it does not divide (the batch then splits as for a fixed count)."""
        if not self.auto_micro_batches:
            return micro_batches == self.config.micro_batches
        return 1 <= micro_batches <= MAX_MICRO_BATCHES and dp * micro_batches <= self.config.global_batch_seqs

    @property
    def config(self) -> TrainConfig:
        """The run's training configuration: the knobs asked for, TrainConfig's defaults for
        the rest."""
        return self.train or TrainConfig(seed=self.seed)

    @classmethod
    def from_args(cls, args: dict) -> TrainRequest:
        def num(key, default, lo, hi):
            v = args.get(key, default)
            if v is None:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise TrainError(f"{key} must be an integer in [{lo}, {hi}]")
            return v
        init_from = _digest_arg(args, "init_from", "the sha256 of the model folder, hf_digest")
        init_name = _name_arg(args, "init_name")
        if init_from is not None:
            if "preset" in args:
                raise TrainError("a start from a model folder (init_from) takes its shape from the folder: "
                                 "it names no preset")
            preset = hf_preset(init_from)
        else:
            preset = args.get("preset", "tiny")
            if preset not in PRESETS:
                raise TrainError(f"unknown preset {preset!r}: choose one of {', '.join(sorted(PRESETS))}")
        if "data" in args:
            raise TrainError("a train start names its data set by hash (data_hash), never by path: every peer "
                             "trains on the data it was started with (`dtfm-peer join --data`)")
        data_hash = _digest_arg(args, "data_hash", "the sha256 of the data set's tokens")
        data_name = _name_arg(args, "data_name")
        stages = args.get("stages")
        if stages == "auto":
            stages = None
        placement = args.get("placement", "scheduler")
        if placement not in PLACEMENTS:
            raise TrainError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        wait_s = args.get("wait_s", 0.0)
        if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or not 0 <= wait_s <= 86400:
            raise TrainError("wait_s must be a number of seconds in [0, 86400]")
        checkpoint_every = num("checkpoint_every", None, 0, 10**9)  # None: the default
        if checkpoint_every is None:
            checkpoint_every = DEFAULT_CHECKPOINT_EVERY
        compress = args.get("compress", "exact")
        if type(compress) is not str:
            raise TrainError("compress must be a compression preset name with FIELD=VALUE options, as a string")
        try:
            compression = parse_compression(compress)
        except ValueError as e:
            raise TrainError(f"compress: {e}") from None
        seed = num("seed", 0, 0, 2**63 - 1)
        knobs: dict[str, Any] = {}
        auto_micro = args.get("micro_batches") == AUTO
        for key, kind in KNOBS.items():
            if key not in args or (key == "micro_batches" and auto_micro):
                continue
            v = args[key]
            ok = type(v) is kind or (kind is float and type(v) is int)
            if not ok:
                raise TrainError(f"{key} must be {_A[kind]}, got {v!r:.40}")
            knobs[key] = float(v) if kind is float else v
        try:
            train = TrainConfig(seed=seed, **knobs) if knobs else None
            if auto_micro:  # (the search starts at the default count, or at what the batch allows the asked D)
                cfg = train or TrainConfig(seed=seed)
                dp_asked = args["dp"] if type(args.get("dp")) is int and args["dp"] >= 1 else 1
                fits = [m for m in micro_batch_options(cfg.global_batch_seqs, dp_asked) if m <= cfg.micro_batches]
                if fits and fits[-1] != cfg.micro_batches:  # (none: refused below, the batch too small)
                    train = replace(cfg, micro_batches=fits[-1])
        except (ValueError, TypeError) as e:
            raise TrainError(f"training config: {e}") from None
        req = cls(auto_micro_batches=auto_micro, preset=preset, steps=num("steps", 100, 1, 10**9), seed=seed, train=train,
                  init_from=init_from, init_name=init_name,
                  stages=num("stages", stages, 1, 4096) if stages is not None else None,
                  dp=num("dp", None, 1, 4096), checkpoint_every=checkpoint_every,
                  data_hash=data_hash, data_name=data_name, placement=placement, min_peers=num("min_peers", 1, 1, 4096),
                  wait_s=float(wait_s), compression=compression)
        # Every micro-batch of every pipeline needs a sample (train.split_batch; a shape the
        # scheduler picks is checked when it is picked).
        cfg, dp = req.config, req.dp or 1
        if auto_micro and not micro_batch_options(cfg.global_batch_seqs, dp):
            raise TrainError(f"global batch {cfg.global_batch_seqs} is too small for {dp} pipelines: raise --batch "
                             "or lower --dp")
        if not auto_micro and cfg.global_batch_seqs < dp * cfg.micro_batches:
            raise TrainError(f"global batch {cfg.global_batch_seqs} is too small for {dp} pipelines x "
                             f"{cfg.micro_batches} micro-batches: raise --batch or lower --micro-batches")
        if req.dp is not None and req.stages is None:
            raise TrainError("--dp needs --stages")
        if placement == "random" and req.stages is None:
            raise TrainError("a random placement needs --stages S (and --dp D)")
        return req

    def check_data(self, corpus: Corpus, spec: GPTSpec | None = None) -> None:
        """TrainError unless `corpus` can feed this run's model (`spec`; by default the preset's):
        enough tokens for one sequence and its target, every token id inside the vocabulary
        (every peer holds the same data, so the coordinator's check holds for all of them,
        before anything is handed out)."""
        spec = spec or PRESETS[self.preset]
        if len(corpus.tokens) < spec.seq_len + 2:
            raise TrainError(f"the data set {corpus.name!r} has {len(corpus.tokens)} tokens, too few for preset "
                             f"{self.preset!r}, which reads sequences of {spec.seq_len} tokens: give every peer "
                             f"more data with `join --data`")
        try:
            corpus.check_vocab(spec.vocab)
        except ValueError as e:
            raise TrainError(str(e)) from None

    def to_args(self) -> dict:
        """The request as `from_args` reads it: what the operator signs (the coordinator
        ignores `min_peers`, which the peer asked first waited for; `wait_s` widens the time in
        which the signed start is taken)."""
        out = {"steps": self.steps, "seed": self.seed,
               "checkpoint_every": self.checkpoint_every, "placement": self.placement,
               "min_peers": self.min_peers, "wait_s": self.wait_s}
        if self.init_from is None:
            out["preset"] = self.preset
        else:
            out["init_from"] = self.init_from
            out["init_name"] = self.init_name
        default = TrainConfig(seed=self.seed)
        for key in KNOBS:
            if getattr(self.config, key) != getattr(default, key):
                out[key] = getattr(self.config, key)
        if self.auto_micro_batches:
            out["micro_batches"] = AUTO
        if self.stages is not None:
            out["stages"] = self.stages
        if self.dp is not None:
            out["dp"] = self.dp
        if self.data_hash is not None:
            out["data_hash"] = self.data_hash
            out["data_name"] = self.data_name
        if not self.compression.exact:
            out["compress"] = self.compression.to_spec()
        return out
