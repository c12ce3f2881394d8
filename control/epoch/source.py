"""Where this peer's stage of an allocation comes from: a pure decision, which the stage host
(control/epoch/stages.py) then carries out (it builds, loads, reads its memory and fetches).

- `Fresh`: a new run from a preset, the run's seeded initial weights;
- `FromFolder`: a new run from a model folder, this stage's layers of this peer's copy;
- `OwnCopy`: this peer holds the stage at the start step (its own copy, or with compressed DP
  its own replica, whatever the holding's digest: see `replicas_differ`); where that copy turns
  out to be gone, `fallback` is the fetch to do instead;
- `Fetch`: the stage assembled from the old stages its layers need (`needed_stages`), each part
  from this peer's own copy where it may have one (`FetchPart.own_first`), else fetched from
  the holders, hash-verified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..allocation import Allocation, Holding
from ..models import HeldModel, start_model

__all__ = ["Fetch", "FetchPart", "Fresh", "FromFolder", "OwnCopy", "StageSource", "needed_stages", "replicas_differ",
           "stage_source"]


def needed_stages(old_ranges: Sequence[tuple[int, int]], new_range: tuple[int, int]) -> list[int]:
    """Indices of the old stages that stage `new_range` takes tensors from: those with blocks
    in it, the old first stage when it starts at 0 (embeddings), the old last when it ends at
    the model's last layer (final norm, head, tied embedding copy)."""
    if not old_ranges:
        raise ValueError("no old layer ranges")
    a, b = new_range
    need = {i for i, (oa, ob) in enumerate(old_ranges) if oa < b and a < ob}
    if a == 0:
        need.add(0)
    if b == old_ranges[-1][1]:
        need.add(len(old_ranges) - 1)
    return sorted(need)


def replicas_differ(alloc: Allocation) -> bool:
    """Whether the DP replicas of a stage legitimately hold different states: with compressed DP
    each keeps its own error-feedback residual and, between DiLoCo synchronisations, its own
    weights and moments. A peer then keeps its own replica of a stage it holds at the start step
    (it loses nothing of it); the holding's digest names one replica, for the peers that fetch."""
    return alloc.compression.dp_method != "exact"


@dataclass(frozen=True)
class Fresh:
    layers: tuple[int, int]


@dataclass(frozen=True)
class FromFolder:
    layers: tuple[int, int]
    held: HeldModel


@dataclass(frozen=True)
class FetchPart:
    holding: Holding
    own_first: bool  # this peer may hold it itself: its own copy is looked for before a fetch


@dataclass(frozen=True)
class Fetch:
    layers: tuple[int, int]
    parts: tuple[FetchPart, ...]


@dataclass(frozen=True)
class OwnCopy:
    holding: Holding
    fallback: Fetch


StageSource = Fresh | FromFolder | OwnCopy | Fetch


def stage_source(alloc: Allocation, me: bytes, held_models: Mapping[str, HeldModel]) -> StageSource:
    """Where `me`'s stage of `alloc` comes from (see the module docstring); ValueError when it
    cannot come from anywhere (a later start step with no holders named, a model folder this
    peer does not hold)."""
    layers = alloc.layer_ranges[alloc.position(me)[1]]
    if not alloc.holdings:
        if alloc.start_step > 0:
            raise ValueError(f"starting at step {alloc.start_step} needs the stage's weights and the "
                             "allocation names no holders")
        held = start_model(alloc, held_models)
        return Fresh(layers) if held is None else FromFolder(layers, held)
    differ = replicas_differ(alloc)
    old_ranges = [h.layer_range for h in alloc.holdings]
    fetch = Fetch(layers, tuple(FetchPart(alloc.holdings[i], me in alloc.holdings[i].holders or differ)
                                for i in needed_stages(old_ranges, layers)))
    own = {h.layer_range: h for h in alloc.holdings}.get(layers)
    if own is not None and (me in own.holders or differ):
        return OwnCopy(own, fetch)
    return fetch
