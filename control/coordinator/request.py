"""What an operator's `train start` asks for (`TrainRequest`, read and checked from the
arguments the CLI or a forwarding peer sends) and the error a train operation answers with
(`TrainError`, its message meant for the operator). The operations are in docs/control.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtfm.train import PRESETS, TrainConfig

__all__ = ["PLACEMENTS", "TrainError", "TrainRequest"]

# How the issuer places peers: the DT-FM scheduler, or a uniformly random allocation of the same
# shape (the baseline the scheduler is measured against).
PLACEMENTS = ("scheduler", "random")


class TrainError(Exception):
    """A `train start` / `train stop` that cannot be done, with the reason for the operator."""


@dataclass(frozen=True)
class TrainRequest:
    """What `dtfm-peer train start` asks for."""

    preset: str = "tiny"
    steps: int = 100
    seed: int = 0
    stages: int | None = None  # None: the scheduler picks the shape
    dp: int | None = None
    checkpoint_every: int = 0
    data_path: str | None = None
    train: TrainConfig | None = None  # None: TrainConfig() with this seed
    placement: str = "scheduler"  # or "random": a random allocation of the given shape (a baseline)
    min_peers: int = 1  # the first configuration forms once this many peers are live and measured
    wait_s: float = 0.0  # how long to wait for them before giving up

    @classmethod
    def from_args(cls, args: dict) -> TrainRequest:
        def num(key, default, lo, hi):
            v = args.get(key, default)
            if v is None:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise TrainError(f"{key} must be an integer in [{lo}, {hi}]")
            return v
        preset = args.get("preset", "tiny")
        if preset not in PRESETS:
            raise TrainError(f"unknown preset {preset!r}: choose one of {', '.join(sorted(PRESETS))}")
        data = args.get("data")
        if data is not None and not isinstance(data, str):
            raise TrainError("data must be a path")
        stages = args.get("stages")
        if stages == "auto":
            stages = None
        placement = args.get("placement", "scheduler")
        if placement not in PLACEMENTS:
            raise TrainError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        wait_s = args.get("wait_s", 0.0)
        if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or not 0 <= wait_s <= 86400:
            raise TrainError("wait_s must be a number of seconds in [0, 86400]")
        req = cls(preset=preset, steps=num("steps", 100, 1, 10**9), seed=num("seed", 0, 0, 2**63 - 1),
                  stages=num("stages", stages, 1, 4096) if stages is not None else None,
                  dp=num("dp", None, 1, 4096), checkpoint_every=num("checkpoint_every", 0, 0, 10**9),
                  data_path=data, placement=placement, min_peers=num("min_peers", 1, 1, 4096),
                  wait_s=float(wait_s))
        if req.dp is not None and req.stages is None:
            raise TrainError("--dp needs --stages")
        if placement == "random" and req.stages is None:
            raise TrainError("a random placement needs --stages S (and --dp D)")
        return req

    def to_args(self) -> dict:
        """The request as `from_args` reads it, forwarded to the coordinator (`min_peers` and
        `wait_s` stay behind: the forwarding peer has waited)."""
        out = {"preset": self.preset, "steps": self.steps, "seed": self.seed,
               "checkpoint_every": self.checkpoint_every, "placement": self.placement}
        if self.stages is not None:
            out["stages"] = self.stages
        if self.dp is not None:
            out["dp"] = self.dp
        if self.data_path is not None:
            out["data"] = self.data_path
        return out
