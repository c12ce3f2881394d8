"""Building the allocations the coordinator hands out (pure): the first epoch of a start and
the next epoch of a run, its council of voters, the members it names absent, what each stage's holders offered, and a
per-link run's compressed links.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace

from dtfm.net import short_id
from dtfm.train import CompressionConfig, LinkCodecs, TrainConfig

from ..allocation import Allocation, Holding
from ..answers import OfferAnswer
from ..epoch.runstate import ResumePoint
from ..epoch.source import needed_stages
from .context import Reads
from .operator_queue import QueuedStart
from .schedule import Placement

__all__ = ["MAX_ABSENT", "MAX_OFFER_HOLDERS", "MIN_REBUILDERS", "NoHolder", "absent", "council_fields", "first_allocation",
           "first_council", "gone_voters", "links_for", "majority_holdings", "next_allocation", "next_council", "offer_holders", "train_of"]

logger = logging.getLogger(__name__)

MAX_OFFER_HOLDERS = 64  # holders of one stage asked to offer it (each then keeps its own copy)
MAX_ABSENT = 4096
# peers asked to rebuild a stage from the run's initial weights, at least (the digest most of them
# give goes into the allocation)
MIN_REBUILDERS = 3


def offer_holders(rp: ResumePoint, layers: tuple[int, int], old_ranges: tuple[tuple[int, int], ...],
                  placement: Placement) -> tuple[bytes, ...]:
    """The peers asked to offer old stage `layers` at the resume point: its holders in memory
    or with a checkpoint; for a stage restored from the run's initial weights, which every peer
    of the run can rebuild, the peers `placement` puts on a stage built from it (each builds it
    anyway, then keeps its own copy) and others up to MIN_REBUILDERS, not every peer of the run:
    each peer asked builds and encodes the stage, and asking all made every peer hold every
    stage of the model, twice. At most MAX_OFFER_HOLDERS."""
    saved = rp.memory.get(layers) or rp.checkpoint.get(layers)
    if saved:
        return tuple(saved[:MAX_OFFER_HOLDERS])
    every = rp.initial.get(layers, ())
    k = old_ranges.index(layers)
    takers = [p for pipe in placement.pipelines for s, p in enumerate(pipe)
              if p in every and k in needed_stages(old_ranges, placement.layer_ranges[s])]
    others = [p for p in every if p not in takers]
    return tuple((takers + others[:max(0, MIN_REBUILDERS - len(takers))])[:MAX_OFFER_HOLDERS])


class NoHolder(Exception):
    """No holder of a stage offered it at the resume step (the layers in the message)."""


def majority_holdings(cur: Allocation, offers: Mapping[tuple[int, int], Mapping[bytes, OfferAnswer]],
                      step: int) -> tuple[Holding, ...]:
    """Per stage of `cur`, the digest most of its holders offered at `step`, with the holders
    that gave it; NoHolder when a stage has none."""
    holdings = []
    for r in cur.layer_ranges:
        by_digest: dict[str, list[bytes]] = {}
        for p, a in offers[r].items():
            if a.digest is not None:
                by_digest.setdefault(a.digest, []).append(p)
            else:
                logger.warning("%s offers no layers %s at step %d: %s", short_id(p), r, step, a.reason)
        if not by_digest:  # (it held them a moment ago: retried, up to max_reconfig_attempts)
            raise NoHolder(f"no holder of layers {r} could offer them at step {step}")
        digest, peers = max(by_digest.items(), key=lambda kv: len(kv[1]))
        if len(by_digest) > 1:
            # with compressed DP the replicas of a stage differ (their error-feedback residuals,
            # DiLoCo's inner steps): each keeps its own, and the digest names one for fetchers
            logger.log(logging.INFO if cur.compression.dp_method != "exact" else logging.ERROR,
                       "holders of layers %s disagree at step %d: %s", r, step,
                       {d[:12]: [short_id(p) for p in ps] for d, ps in by_digest.items()})
        holdings.append(Holding(r, digest, tuple(sorted(peers))))
    return tuple(holdings)


def first_allocation(r: Reads, start: QueuedStart, shape: Placement, me_leaving: bool) -> Allocation:
    """The first epoch of an operator's start: its first placement, from step 0 (at the
    micro-batch count the scheduler chose, where the start left it to the scheduler)."""
    req = start.req
    placed = {p for pipe in shape.pipelines for p in pipe} | set(shape.spares)
    return Allocation(epoch=r.election.last_applied[1] + 1, term=r.election.term, issuer=r.me,
                      pipelines=shape.pipelines, layer_ranges=shape.layer_ranges, preset=req.preset,
                      model=start.model, train=train_of(req.config, shape),
                      data_hash=str(req.data_hash), data_name=start.data_name, start_step=0,
                      end_step=req.steps, checkpoint_every=req.checkpoint_every,
                      predicted_iteration_s=shape.predicted_iteration_s, spares=shape.spares,
                      absent=absent(r, placed, me_leaving), run_id=start.op.run_id, reason="train start",
                      **council_fields(r, placed, set(r.swarm.live_peers()) | {r.me}),
                      operator_start=start.signed.encode(), compression=req.compression,
                      compress_links=links_for(shape, req.compression))


def train_of(cfg: TrainConfig, shape: Placement) -> TrainConfig:
    """The training config an allocation of `shape` carries: `cfg` at the micro-batch count the
    scheduler chose with the placement (it chooses one only where the run's start left it to
    the scheduler; every peer checks it against the start) and with the placement's pipeline
    schedule (`Placement.warmups`; GPipe where it has none)."""
    micro = cfg.micro_batches if shape.micro_batches is None else shape.micro_batches
    warmups = shape.warmups_text()
    if (micro, warmups) == (cfg.micro_batches, cfg.pipeline_warmups):
        return cfg
    return replace(cfg, micro_batches=micro, pipeline_warmups=warmups)


def next_allocation(r: Reads, cur: Allocation, shape: Placement, rp: ResumePoint, holdings: tuple[Holding, ...],
                    trigger: str, reachable: set[bytes], me_leaving: bool) -> Allocation:
    """The next epoch of the run: the new layout from the resume point, with the holdings (at
    the micro-batch count the placement was chosen at, where the run's start left it to the
    scheduler; else the run's)."""
    named = {p for pipe in shape.pipelines for p in pipe} | set(shape.spares)
    return Allocation(epoch=r.election.last_applied[1] + 1, term=r.election.term, issuer=r.me,
                      run_id=cur.run_id, pipelines=shape.pipelines, layer_ranges=shape.layer_ranges,
                      preset=cur.preset, model=cur.model, train=train_of(cur.train, shape),
                      data_hash=cur.data_hash,
                      data_name=cur.data_name, start_step=rp.step, end_step=cur.end_step,
                      checkpoint_every=cur.checkpoint_every, predicted_iteration_s=shape.predicted_iteration_s,
                      spares=shape.spares, holdings=holdings, absent=absent(r, named, me_leaving),
                      reason=trigger[:1024], **council_fields(r, named, reachable),
                      operator_start=cur.operator_start, compression=cur.compression,
                      compress_links=links_for(shape, cur.compression),
                      last_op_ms=r.epoch.op_floor_ms(cur.run_id))


def council_fields(r: Reads, named: set[bytes], reachable: set[bytes]) -> dict:
    """The allocation's `voters` and `council`: one step toward a council of its root's size
    of live voters spread over the regions (`next_council`), when the election can make it now
    (else the council as it is); ValueError when this peer has no council to hand out."""
    old = tuple(r.election.voters)
    live = set(r.swarm.live_peers()) | {r.me}  # (a removed voter must be gone to every peer's gossip)
    own = r.election.council
    size = own.size if own is not None else r.timings.council_size  # (the operator's root names it)
    want = next_council(old, named & reachable & live, live, r.swarm.regions(), size, r.me)
    epoch = r.election.last_applied[1] + 1  # (the allocation's, as both callers build it)
    council = r.election.council_for(want, epoch) if want != old else None
    if council is None:
        council = r.election.council_for(old, epoch)
    if council is None:
        raise ValueError("this peer holds no council to hand out (it is not the certified coordinator)")
    return {"voters": council.voters, "council": council.encode()}


def absent(r: Reads, named: set[bytes], me_leaving: bool) -> tuple[bytes, ...]:
    """Every member this peer knows of that has no place: peers whose gossip still counts
    one of them alive must not refuse the allocation for leaving it out (this peer too
    when it leaves: it issues an allocation without itself)."""
    me = set() if me_leaving else {r.me}
    return tuple(sorted(set(r.swarm.known_peers()) - named - me)[:MAX_ABSENT])


def first_council(me: bytes, live: set[bytes], regions: Mapping[bytes, str], size: int) -> tuple[bytes, ...]:
    """A first council for an operator's start: this peer, then live peers added as
    `next_council` would add them, up to `size`."""
    voters: tuple[bytes, ...] = (me,)
    while len(voters) < size:
        grown = next_council(voters, live, live | {me}, regions, size, me)
        if grown == voters:
            break
        voters = grown
    return voters


def gone_voters(voters: Iterable[bytes], reachable: Iterable[bytes], me: bytes) -> list[bytes]:
    """The voters the next council takes out first, in order: those this peer cannot reach (its
    gossip counts them dead), never itself."""
    return sorted(set(voters) - set(reachable) - {me})


def next_council(old_voters: tuple[bytes, ...], candidates: set[bytes], reachable: set[bytes],
                 regions: Mapping[bytes, str], size: int, me: bytes) -> tuple[bytes, ...]:
    """The next council: one voter from the current one toward `size` live voters spread over
    the regions. An unreachable voter goes out first; else, below `size`, the candidate (a
    reachable peer of the allocation) of the region the council has fewest voters of comes in;
    else, above `size`, a voter of the region it has most of goes out. Never this peer (the
    issuer, elected by the council). One voter a step, so every quorum of the old council meets
    every quorum of the new (election/certificate.py); the rest goes at the next epochs."""
    old = set(old_voters)
    new = set(old)

    def region(p: bytes) -> str:
        return regions.get(p, "")

    def held(r: str, among: set[bytes]) -> int:
        return sum(1 for v in among if region(v) == r)

    def order(p: bytes) -> bytes:  # a stable tie-break every peer computes alike
        return hashlib.blake2b(p, digest_size=8).digest()

    gone = gone_voters(old_voters, reachable, me)
    joining = candidates - old - {me}
    if gone:
        new.discard(gone[0])
    elif len(old) < size and joining:
        new.add(min(joining, key=lambda p: (held(region(p), old), order(p))))
    elif len(old) > size:
        leaving = old - {me}
        if leaving:
            new.discard(max(leaving, key=lambda p: (held(region(p), old), order(p))))
    return tuple(sorted(new))


def links_for(shape: Placement, compression: CompressionConfig) -> LinkCodecs | None:
    """The allocation's `compress_links`: a per-link run's choice from the planner, or (a planner
    that chose none) every link and group compressed; None for any other run."""
    if not compression.per_link:
        return None
    return shape.links or LinkCodecs.uniform(len(shape.layer_ranges), len(shape.pipelines))
