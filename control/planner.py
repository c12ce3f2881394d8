"""The coordinator's two seams onto a daemon (see docs/control.md, "The shell"): the gossiped
swarm as the coordinator reads it (`GossipSwarm`, its `Swarm`), and the scheduler with the
plane's budget and hysteresis (`SchedulerPlanner`, its `Planner`), whose plans' estimated links
are measured before one is handed out (`confirm`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from dtfm.files import atomic_write
from dtfm.gossip import DISAGREEMENT_RATIO, GossipService, NetworkView, build_view
from dtfm.net import ProtocolError
from dtfm.sched import UPDATE_KIND, ScheduleInputs
from dtfm.train import GPTSpec, TrainConfig

from .allocation import Allocation
from .compute import KindProbe, MachineNow, run_model, with_fresh_compute, with_training_compute
from .config import PlaneConfig
from .coordinator.allocate import train_of
from .coordinator.request import TrainRequest
from .coordinator.reshape import ReshapePlan, reshape
from .coordinator.schedule import (Placement, choose_links, choose_shape, compression_options_of, compute_busy_fraction,
                                   fit_schedule, predict_uniform, random_shape, time_to_loss_s)
from .operator import SignedOp

__all__ = ["CONFIRM_ROUNDS", "GossipSwarm", "SchedulerPlanner", "plan_links"]

logger = logging.getLogger(__name__)


class GossipSwarm:
    """The gossiped swarm as the coordinator reads it."""

    def __init__(self, gossip: GossipService, me: bytes):
        self.gossip, self.me = gossip, me

    def live_peers(self) -> list[bytes]:
        return list(self.gossip.live_peers())

    def known_peers(self) -> list[bytes]:
        return [m.peer_id for m in self.gossip.members()]

    def regions(self) -> dict[bytes, str]:
        return {m.peer_id: m.region for m in self.gossip.members()}

    def view(self) -> NetworkView:
        return self.gossip.view()

    def incarnations(self) -> dict[bytes, int]:
        return {m.peer_id: m.incarnation for m in self.gossip.members()}

    def measured_view(self, candidates: Iterable[bytes]) -> tuple[NetworkView, list[bytes]]:
        """The view over `candidates`, leaving out (worst first) peers with links that gossip
        has neither measured nor can estimate yet: a restarted or joined peer is placed once
        its report holds a coordinate and its capacities (links its plan uses are measured
        before hand-out: `SchedulerPlanner`)."""
        peers = sorted(set(candidates))
        left: list[bytes] = []
        while True:
            view = build_view(tuple(peers), self.gossip.records.reports, now_wall=time.time())
            if view.complete or len(peers) <= 1:
                return view, left
            known = np.isfinite(view.delay_ms) & np.isfinite(view.bandwidth_gbps)
            unknown = ~known & ~np.eye(len(peers), dtype=bool)
            worst = peers[int(np.argmax(unknown.sum(axis=0) + unknown.sum(axis=1)))]
            peers.remove(worst)
            left.append(worst)


CONFIRM_ROUNDS = 2  # plans whose estimated links are measured before one is handed out
SCHEDULES_KEPT = 8  # first placements' inputs kept in the data dir


def _logged(gpipe: Placement, fitted: Placement) -> Placement:
    """`fitted` (`fit_schedule` of `gpipe`), its schedule logged where it is not GPipe."""
    if fitted.warmups is not None:
        logger.info("pipeline schedule: 1F1B with warm-ups %s, predicted %.3f s/step against %.3f s in GPipe",
                    fitted.warmups_text(), fitted.predicted_iteration_s, gpipe.predicted_iteration_s)
    return fitted


def asked_start(alloc: Allocation) -> TrainRequest | None:
    """The operator's start the allocation carries, as its peers checked it: the stage and
    pipeline counts it asked for (`--stages`, `--dp`; None: the scheduler's), whether it left
    the micro-batch count to the scheduler. None when the start cannot be read."""
    try:
        return SignedOp.decode(alloc.operator_start).open().request()
    except (ProtocolError, ValueError):
        return None


def plan_links(placement: Placement) -> list[tuple[bytes, bytes]]:
    """The links a placement's steps use: each pipeline's consecutive stages, and every pair
    of a stage's data-parallel group."""
    links = [(p[s], p[s + 1]) for p in placement.pipelines for s in range(len(p) - 1)]
    for s in range(len(placement.layer_ranges)):
        group = [p[s] for p in placement.pipelines if s < len(p)]
        links += [(a, b) for i, a in enumerate(group) for b in group[i + 1:]]
    return links


def _estimates_held(before: NetworkView, after: NetworkView, links: list[tuple[bytes, bytes]]) -> bool:
    """Whether the figures measured for `links` are within DISAGREEMENT_RATIO of the estimates
    the plan was made on (a link still unmeasured counts as held)."""
    i_before = {p: i for i, p in enumerate(before.peers)}
    i_after = {p: i for i, p in enumerate(after.peers)}
    for a, b in links:
        i, j, k, m = i_before[a], i_before[b], i_after.get(a), i_after.get(b)
        if k is None or m is None or not after.measured()[k, m]:
            continue
        for old, new in ((before.delay_ms[i, j], after.delay_ms[k, m]),
                         (before.bandwidth_gbps[i, j], after.bandwidth_gbps[k, m])):
            if min(old, new) > 0 and max(old, new) / min(old, new) > DISAGREEMENT_RATIO:
                return False
    return True


class SchedulerPlanner:
    """`reshape` and the first placement with the plane's budget and hysteresis, on the
    gossiped view with its estimates; with `confirm`, the links of the plan chosen that are
    estimated are measured before it is returned (`confirm(view, links)` measures them and
    returns the view over the same peers after), and when the measurements disagree with the
    estimates the search runs again on them, up to CONFIRM_ROUNDS times."""

    def __init__(self, config: PlaneConfig,
                 confirm: Callable[[NetworkView, list[tuple[bytes, bytes]]], NetworkView | None] | None = None,
                 kind_probe: KindProbe | None = None, inputs_dir: Path | None = None,
                 fresh_compute: Callable[[], MachineNow] | None = None, host: bytes = b""):
        self.config = config
        self.confirm = confirm
        self.kind_probe = kind_probe
        self.inputs_dir = inputs_dir  # where each first placement's `ScheduleInputs` are kept
        # this machine (`host`) timed now, for the first placement (`MachineNow`; blocking: the
        # planner runs in a worker thread)
        self.fresh_compute, self.host = fresh_compute, host

    def machine_now(self, view: NetworkView) -> MachineNow | None:
        """This machine timed now, where the view has peers of it; None without a probe, a
        host, or when the probe fails (the figures reported stand)."""
        if self.fresh_compute is None or not self.host or self.host not in view.hosts:
            return None
        try:
            machine = self.fresh_compute()
        except Exception as e:  # (the figures reported stand)
            logger.warning("cannot time this machine's compute now: %s; the peers' reported figures stand", e)
            return None
        logger.info("this machine timed now: the reference block in %.1f ms, %.2f of a core for one thread, "
                    "%d cores (%d of its peers in the view)", machine.compute_ms, machine.cpu_share, machine.cpus,
                    sum(h == self.host for h in view.hosts))
        return machine

    def kind(self, model: GPTSpec, train: TrainConfig, n: int, *, auto_micro_batches: bool = False) -> dict[int, float]:
        """The run's layer's `kind_factors` at the micro-batch of every pipeline count n peers
        allow (and, with `auto_micro_batches`, every micro-batch count the scheduler may choose
        for it), and its optimizer update (`UPDATE_KIND`), from `kind_probe` (blocking: the
        planner runs in a worker thread); none without a probe or when it fails (the scheduler
        then costs the layers at the reference rate)."""
        if self.kind_probe is None:
            return {}
        rm = run_model(model, train, auto_micro_batches=auto_micro_batches)
        batches = tuple(sorted({UPDATE_KIND} | set(rm.micro_batch_sizes(min(n, rm.d_max)))))
        try:
            return dict(self.kind_probe(model, batches))
        except Exception as e:  # (a probe that cannot run costs the layers at the reference rate)
            logger.warning("cannot probe the run's layer: %s; its compute is costed at the reference rate", e)
            return {}

    def _confirmed(self, view: NetworkView, search: Callable[[NetworkView], Any],
                   placement_of: Callable[[Any], Placement]) -> Any:
        plan = search(view)
        if self.confirm is None:
            return plan
        for _ in range(CONFIRM_ROUNDS):
            todo = view.unmeasured(plan_links(placement_of(plan)))
            if not todo:
                return plan
            fresh = self.confirm(view, todo)
            if fresh is not None and not fresh.complete:  # (a record aged out meanwhile: no search on it)
                logger.info("the view after measuring the plan's links lacks %d links: the plan stands",
                            len(fresh.peers) * (len(fresh.peers) - 1) - fresh.pairs_known())
                return plan
            if fresh is None or _estimates_held(view, fresh, todo):
                return plan
            logger.info("the plan's links measured other than estimated: scheduling again on %d measured links",
                        len(todo))
            view = fresh
            plan = search(view)
        return plan

    def reshape(self, view: NetworkView, cur: Allocation, *, live: frozenset[bytes], remaining_steps: int,
                regions: dict[bytes, str], seed: int, force: bool,
                cut: frozenset[tuple[bytes, bytes]] = frozenset()) -> ReshapePlan:
        return self._confirmed(view, lambda v: self._reshape(v, cur, live=live, remaining_steps=remaining_steps,
                                                              regions=regions, seed=seed, force=force, cut=cut),
                               lambda plan: plan.placement)

    def _reshape(self, view: NetworkView, cur: Allocation, *, live: frozenset[bytes], remaining_steps: int,
                 regions: dict[bytes, str], seed: int, force: bool,
                 cut: frozenset[tuple[bytes, bytes]] = frozenset()) -> ReshapePlan:
        """The reconfiguration (`_reshape_shape`), its placement with its pipeline schedule
        (`fit_schedule`), on the view with each idle peer costed no faster than its machine's
        training peers measure (`with_training_compute`)."""
        view = with_training_compute(view)
        asked = asked_start(cur)  # (decoded once: the signature is checked on each decode)
        kind = self.kind(cur.model, cur.train, len(view.peers),
                         auto_micro_batches=asked is not None and asked.auto_micro_batches)
        plan = self._reshape_shape(view, cur, asked, kind, live=live, remaining_steps=remaining_steps,
                                   regions=regions, seed=seed, force=force, cut=cut)
        if self.config.pipeline_schedule == "gpipe":
            return plan
        fitted = fit_schedule(view, plan.placement, cur.model, train_of(cur.train, plan.placement), cur.compression,
                              kind=kind, window_messages=self.config.comm.window_messages)
        return replace(plan, placement=_logged(plan.placement, fitted))

    def _reshape_shape(self, view: NetworkView, cur: Allocation, asked: TrainRequest | None,
                       kind: dict[int, float], *, live: frozenset[bytes], remaining_steps: int,
                       regions: dict[bytes, str], seed: int, force: bool,
                       cut: frozenset[tuple[bytes, bytes]] = frozenset()) -> ReshapePlan:
        per_link = cur.compression.per_link  # (then the candidates are costed knowing the codecs)
        auto_m = asked is not None and asked.auto_micro_batches
        plan = reshape(view, cur.model, cur.train, current=cur.plan(), live=live,
                       remaining_steps=remaining_steps, regions=regions, time_budget_s=self.config.schedule_time_s,
                       seed=seed, min_gain=self.config.min_gain, force=force, cut_links=cut,
                       keep_stages=asked is not None and asked.stages is not None,
                       keep_dp=asked.dp if asked is not None else None, kind=kind,
                       auto_micro_batches=auto_m,
                       window_messages=self.config.comm.window_messages,
                       fit_schedules=self.config.pipeline_schedule == "fitted",
                       compression=None if cur.compression.exact else compression_options_of(cur.compression, view=view))
        if cur.compression.exact:
            return plan
        if not per_link:  # compressed on every link and group
            return replace(plan, placement=predict_uniform(view, plan.placement, cur.model,
                                                           train_of(cur.train, plan.placement), cur.compression,
                                                           kind=kind, window_messages=self.config.comm.window_messages))
        links = cur.compress_links
        kept = [r for s, r in enumerate(cur.layer_ranges) if links is None or links.dp[s]]
        return replace(plan, placement=choose_links(view, plan.placement, cur.model, train_of(cur.train, plan.placement),
                                                    cur.compression, keep_compressed=kept, kind=kind,
                                                    window_messages=self.config.comm.window_messages))

    def first_placement(self, view: NetworkView, req: TrainRequest, model: GPTSpec, train: TrainConfig,
                        regions: dict[bytes, str]) -> Placement:
        """A new run's shape: the scheduler's on the gossiped view, or (`--placement random`) a
        random one of the asked stages x dp (ValueError when none fits)."""
        placement = self._confirmed(view, lambda v: self._first_placement(v, req, model, train, regions),
                                    lambda plan: plan)
        if placement.inputs is not None and self.inputs_dir is not None:
            self._keep_inputs(placement.inputs)
        return placement

    def _keep_inputs(self, inputs: ScheduleInputs) -> None:
        """Write a first placement's inputs to `inputs_dir` (the newest SCHEDULES_KEPT stay), for
        `dtfm-sched solve --view FILE` to replay; a failed write is logged, nothing more."""
        assert self.inputs_dir is not None
        path = self.inputs_dir / time.strftime("schedule-%Y%m%dT%H%M%S.json", time.gmtime())
        try:
            self.inputs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(path, inputs.to_json())
            for old in sorted(self.inputs_dir.glob("schedule-*.json"))[:-SCHEDULES_KEPT]:
                old.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("cannot keep the scheduler's inputs in %s: %s", path, e.strerror)
            return
        logger.info("the scheduler's inputs are in %s (`dtfm-sched solve --view %s` replays the choice)", path, path)

    def _first_placement(self, view: NetworkView, req: TrainRequest, model: GPTSpec, train: TrainConfig,
                         regions: dict[bytes, str]) -> Placement:
        """The search on the view with this machine timed now (`MachineNow`): its peers' figures
        scaled to its reference block now (`with_fresh_compute`), searched once; then, when the
        shape found places several of them, slowed by their competing for its cores
        (`MachineNow.slowdown`) and searched again, the second search's plan handed out."""
        auto_m = req.auto_micro_batches and req.placement != "random"
        kind = self.kind(model, train, len(view.peers), auto_micro_batches=auto_m)
        machine = self.machine_now(view)  # (after the layer probe, which times the reference block too)
        if machine is None:
            return self._place(view, req, model, train, regions, kind, auto_m)
        view = with_fresh_compute(view, self.host, machine.compute_ms)
        placement = self._place(view, req, model, train, regions, kind, auto_m)
        host_of = dict(zip(view.peers, view.hosts))
        placed = sum(host_of.get(p) == self.host for pipe in placement.pipelines for p in pipe)
        if placed <= 1:
            return placement
        busy = compute_busy_fraction(view, placement, model, train_of(train, placement), kind=kind)
        slowdown = machine.training_slowdown(placed, busy)
        if slowdown <= 1.0:
            return placement
        logger.info("%d peers of this machine placed, the busiest computing %.0f %% of a step: each computes "
                    "%.2fx slower than timed alone; searching again", placed, 100 * busy, slowdown)
        mine = np.array([h == self.host for h in view.hosts], dtype=bool)
        return self._place(replace(view, compute_ms=np.where(mine, view.compute_ms * slowdown, view.compute_ms)),
                           req, model, train, regions, kind, auto_m)

    def _place(self, view: NetworkView, req: TrainRequest, model: GPTSpec, train: TrainConfig,
               regions: dict[bytes, str], kind: dict[int, float], auto_m: bool) -> Placement:
        """The placement (`_shape`) with its pipeline schedule (`fit_schedule`); with the fitted
        schedule, shapes are ranked under the schedule each would run (`choose_shape`'s
        `fit_schedules`), and a per-link run's two candidate plans compared under theirs."""
        def scheduled(shape: Placement) -> Placement:
            if self.config.pipeline_schedule == "gpipe":
                return shape
            return _logged(shape, fit_schedule(view, shape, model, train_of(train, shape), req.compression,
                                               kind=kind, window_messages=self.config.comm.window_messages))

        return self._shape(view, req, model, train, regions, kind, auto_m, scheduled)

    def _shape(self, view: NetworkView, req: TrainRequest, model: GPTSpec, train: TrainConfig,
               regions: dict[bytes, str], kind: dict[int, float], auto_m: bool,
               scheduled: Callable[[Placement], Placement]) -> Placement:
        dp = req.dp  # None: the scheduler chooses it, with --stages too
        fit = self.config.pipeline_schedule == "fitted"
        per_link = req.compression.per_link  # (then the search knows the codecs, and each link is chosen)
        if req.placement == "random":
            if req.stages is None:  # (TrainRequest refuses a random placement without --stages)
                raise ValueError("a random placement needs --stages and --dp")
            width = dp if dp is not None else max(1, len(view.peers) // req.stages)  # (random: every peer placed)
            shape = random_shape(view, model, train, stages=req.stages, dp=width, seed=req.seed, kind=kind,
                                 window_messages=self.config.comm.window_messages)
        elif req.compression.exact:
            return scheduled(choose_shape(view, model, train, stages=req.stages, dp=dp, regions=regions,
                                          time_budget_s=self.config.schedule_time_s, seed=req.seed, kind=kind,
                                          auto_micro_batches=auto_m, window_messages=self.config.comm.window_messages,
                                          fit_schedules=fit))
        elif not per_link:  # compressed on every link and group: the search knows the codecs
            shape = choose_shape(view, model, train, stages=req.stages, dp=dp, regions=regions,
                                 time_budget_s=self.config.schedule_time_s, seed=req.seed, kind=kind,
                                 compression=compression_options_of(req.compression, view=view),
                                 auto_micro_batches=auto_m, window_messages=self.config.comm.window_messages,
                                 fit_schedules=fit)
        else:
            # Two searches, each with half the time: one knowing the codecs, one for exact tensors;
            # each gets its links chosen, and the plan faster to the target loss wins (the
            # simulator's iteration over its codecs' step efficiency: `time_to_loss_s`). The search's
            # objective (the paper's, with each link's cheapest codec) can miss what the
            # simulator counts, the trainer's own round trips above all (a swarm measured the
            # codec-aware plan 41 % slower than every link compressed on the exact search's,
            # before each search's allocation was refined on the simulator: sched/fastest.py).
            half = self.config.schedule_time_s / 2
            shapes = [choose_shape(view, model, train, stages=req.stages, dp=dp, regions=regions, time_budget_s=half,
                                   seed=req.seed, compression=opts, kind=kind, auto_micro_batches=auto_m,
                                   window_messages=self.config.comm.window_messages, fit_schedules=fit)
                      for opts in (compression_options_of(req.compression, view=view), None)]
            candidates = [scheduled(choose_links(view, shape, model, train_of(train, shape), req.compression,
                                                 kind=kind, window_messages=self.config.comm.window_messages))
                          for shape in shapes]
            return min(candidates, key=lambda p: time_to_loss_s(p, req.compression))  # (the codec-aware one on a tie)
        if per_link:
            return scheduled(choose_links(view, shape, model, train_of(train, shape), req.compression, kind=kind,
                                          window_messages=self.config.comm.window_messages))
        if not req.compression.exact:
            return scheduled(predict_uniform(view, shape, model, train_of(train, shape), req.compression, kind=kind,
                                             window_messages=self.config.comm.window_messages))
        return scheduled(shape)
