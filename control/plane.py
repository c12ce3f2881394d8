"""The control plane of one daemon: it accepts allocations and runs its stage, and, on the
daemon where `train start` was given, it issues the allocation and follows the run.

Hand-out (issuer, then every peer of the allocation, the issuer included):

1. ALLOCATION: the signed allocation goes to every peer. Each checks everything
   (`check_allocation`), builds its stage, opens its neighbour connections, then answers
   accepted, or refused with a reason that reaches the operator.
2. START: once every peer accepted, the issuer tells all to start. No peer runs a step before.
   If any refused, the others are told STOP and drop the epoch.
3. STEP: after each step every peer reports to the issuer, which writes `train.jsonl` (one line
   per step every peer completed) in its data dir.
4. STOP (`train stop` on any peer of the run): every peer ends before the same step, so the run
   ends on a step boundary. A peer of the allocation that dies or leaves makes every other peer
   fail its current step at once and stop; the half-done step is discarded.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import trio

from dtfm.gossip import GossipService, Member
from dtfm.net import Identity, ProtocolError, RemoteError, RequestTimeout, ConnectionClosed, short_id
from dtfm.train import PRESETS, CommError, Corpus, MessageRules, StageState, TrainConfig, get_preset, load_corpus

from .allocation import AcceptContext, Allocation, SignedAllocation, check_allocation
from .comm import CommConfig, TensorRouter, TransportComm
from .messages import ControlMsg
from .runner import RunEnd, StageRunner, StepReport
from .schedule import PLACEMENTS, choose_shape, random_shape

__all__ = ["ControlPlane", "TrainerConfig", "TrainRequest", "TrainError"]

logger = logging.getLogger(__name__)

MAX_RECENT_STEPS = 64


class TrainError(Exception):
    """A `train start` / `train stop` that cannot be done, with the reason for the operator."""


@dataclass(frozen=True)
class TrainerConfig:
    """The daemon's trainer settings."""

    # torch threads of the stage worker; several daemons on one machine want 1 each.
    torch_threads: int = 1
    # How long a peer may take to build its stage and connect its neighbours before the issuer
    # gives up on the hand-out.
    accept_timeout_s: float = 120.0
    # START and STOP requests, one per peer.
    request_timeout_s: float = 10.0
    # Scheduler time when `train start` picks the shape.
    schedule_time_s: float = 3.0
    # Torch data set of this peer (`--data`); None: the standard library's source.
    data_path: str | None = None

    def __post_init__(self) -> None:
        if self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1")
        for name in ("accept_timeout_s", "request_timeout_s", "schedule_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


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

    @classmethod
    def from_args(cls, args: dict) -> "TrainRequest":
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
        req = cls(preset=preset, steps=num("steps", 100, 1, 10**9), seed=num("seed", 0, 0, 2**63 - 1),
                  stages=num("stages", stages, 1, 4096) if stages is not None else None,
                  dp=num("dp", None, 1, 4096), checkpoint_every=num("checkpoint_every", 0, 0, 10**9),
                  data_path=data, placement=placement)
        if req.dp is not None and req.stages is None:
            raise TrainError("--dp needs --stages")
        if placement == "random" and req.stages is None:
            raise TrainError("a random placement needs --stages S (and --dp D)")
        return req


class _Run:
    """This peer's part in one epoch: the allocation, its stage, its comm, its runner."""

    def __init__(self, alloc: Allocation, state: StageState | None, comm: TransportComm | None,
                 runner: StageRunner | None):
        self.alloc, self.state, self.comm, self.runner = alloc, state, comm, runner
        self.started = trio.Event()
        self.end: RunEnd | None = None
        self.cancel = trio.CancelScope()


class _Issued:
    """The issuer's record of a run it handed out: step reports and the training log."""

    def __init__(self, alloc: Allocation, log_path: Path):
        self.alloc = alloc
        self.log_path = log_path
        self.reports: dict[int, dict[bytes, StepReport]] = {}
        self.completed = alloc.start_step - 1
        self.recent: list[dict] = []
        self.state = "handing out"
        self.reason = ""
        self.started_at = time.time()

    def add(self, peer: bytes, rep: StepReport) -> dict | None:
        if rep.epoch != self.alloc.epoch or rep.step <= self.completed or peer not in self.alloc.peers:
            return None
        self.reports.setdefault(rep.step, {})[peer] = rep
        got = self.reports.get(self.completed + 1, {})
        if len(got) < len(self.alloc.peers):
            return None
        step = self.completed + 1
        del self.reports[step]
        self.completed = step
        losses = [r.loss for r in got.values() if r.loss is not None]
        iteration_s = max(r.iteration_s for r in got.values())
        tokens = self.alloc.train.global_batch_seqs * self.alloc.model.seq_len
        line = {"step": step, "loss": losses[0] if losses else None, "epoch": self.alloc.epoch,
                "iteration_s": iteration_s, "tokens_per_s": tokens / iteration_s if iteration_s > 0 else None,
                "predicted_iteration_s": self.alloc.predicted_iteration_s,
                "compute_s": max(r.compute_s for r in got.values()),
                "pipeline_s": max(r.pipeline_s for r in got.values()),
                "sync_s": max(r.sync_s for r in got.values()),
                "time": time.time()}
        self.recent = (self.recent + [line])[-MAX_RECENT_STEPS:]
        with open(self.log_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return line


class ControlPlane:
    def __init__(self, transport, identity: Identity, gossip: GossipService, data_dir: Path,
                 config: TrainerConfig | None = None, comm_config: CommConfig | None = None):
        self.transport, self.identity, self.gossip = transport, identity, gossip
        self.me = identity.peer_id
        self.data_dir = Path(data_dir)
        self.config = config or TrainerConfig()
        self.comm_config = comm_config or CommConfig()
        self.router = TensorRouter(transport)
        self._corpora: dict[str | None, Corpus] = {}
        self._run: _Run | None = None
        self._issued: _Issued | None = None
        self._applied: dict[bytes, tuple[int, int]] = {}  # run_id -> (term, epoch) applied
        self._last_end: dict | None = None
        self._nursery: trio.Nursery | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.transport.handle(ControlMsg.ALLOCATION, self._on_allocation)
        self.transport.handle(ControlMsg.START, self._on_start)
        self.transport.handle(ControlMsg.STOP, self._on_stop)
        self.transport.handle(ControlMsg.STEP, self._on_step)
        self.gossip.on_member_change(self._on_member_change)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._abort_run("the daemon is leaving")

    # ---- corpus -------------------------------------------------------------------------------

    async def corpus(self, path: str | None = None) -> Corpus:
        key = path if path is not None else self.config.data_path
        if key not in self._corpora:
            try:
                self._corpora[key] = await trio.to_thread.run_sync(load_corpus, key)
            except ValueError as e:
                raise TrainError(str(e)) from None
        return self._corpora[key]

    # ---- peer side ----------------------------------------------------------------------------

    async def _on_allocation(self, conn, msg_type, body, payload) -> dict:
        try:
            signed = SignedAllocation.from_wire(body)
            alloc = signed.open()
        except ProtocolError as e:
            logger.warning("refused an allocation from %s: %s", conn.short_id, e)
            return {"accepted": False, "code": "bad-allocation", "reason": str(e)}
        return await self.accept(alloc)

    async def accept(self, alloc: Allocation) -> dict:
        """Check, build the stage and connect the neighbours; the answer goes to the issuer."""
        corpus = await self.corpus()
        live = frozenset(self.gossip.live_peers()) | {self.me}
        ctx = AcceptContext(me=self.me, live=live, known_presets=PRESETS, data_hash=corpus.fingerprint,
                            data_name=corpus.name, applied=self._applied.get(alloc.run_id), run_id=alloc.run_id,
                            known=frozenset(m.peer_id for m in self.gossip.members()))
        refusal = check_allocation(alloc, ctx)
        if refusal is not None:
            logger.warning("refused allocation epoch %d from %s: %s", alloc.epoch, short_id(alloc.issuer),
                           refusal.reason)
            return {"accepted": False, "code": refusal.code, "reason": refusal.reason}
        self._abort_run(f"replaced by epoch {alloc.epoch}")
        self._applied[alloc.run_id] = (alloc.term, alloc.epoch)
        if self.me not in alloc.peers:
            self._run = _Run(alloc, None, None, None)
            return {"accepted": True, "role": "spare"}
        try:
            state = await trio.to_thread.run_sync(self._build_state, alloc)
        except (ValueError, OSError) as e:
            return {"accepted": False, "code": "build-failed", "reason": f"{short_id(self.me)}: {e}"}
        plan = alloc.plan()
        rules = MessageRules.for_peer(plan, alloc.model, alloc.train, self.me,
                                      [tuple(p.shape) for p in state.params.values()])
        comm = TransportComm(self.transport, rules, run=alloc.run_id, router=self.router,
                             config=self.comm_config)
        members = {m.peer_id: m for m in self.gossip.members()}
        addresses = {p: members[p].address for p in rules.peers if p in members}
        run = _Run(alloc, state, comm, None)
        self._run = run
        assert self._nursery is not None
        await self._nursery.start(self._serve_run, run)
        try:
            await comm.connect(addresses, self.config.accept_timeout_s / 2)
        except (CommError, OSError, ConnectionClosed, RequestTimeout, ProtocolError, trio.TooSlowError) as e:
            self._abort_run(f"could not connect the neighbours: {e}")
            return {"accepted": False, "code": "connect-failed", "reason": f"{short_id(self.me)}: {e}"}
        run.runner = StageRunner(state, plan, self.me, comm, corpus, end_step=alloc.end_step,
                                 checkpoint_every=alloc.checkpoint_every,
                                 checkpoint_dir=self.data_dir / "checkpoints",
                                 torch_threads=self.config.torch_threads,
                                 on_step=self._reporter(alloc))
        d, s = alloc.position(self.me)
        logger.info("accepted epoch %d: stage %d of pipeline %d, layers %s, steps %d..%d", alloc.epoch, s, d,
                    alloc.layer_ranges[s], alloc.start_step, alloc.end_step - 1)
        return {"accepted": True, "role": "stage", "stage": s, "pipeline": d}

    def _build_state(self, alloc: Allocation) -> StageState:
        s = alloc.position(self.me)[1]
        state = StageState(alloc.model, alloc.train, alloc.layer_ranges[s])
        if alloc.start_step > 0:
            raise ValueError(f"starting at step {alloc.start_step} needs the stage's weights, "
                             "and recovering them is not supported yet")
        return state

    async def _serve_run(self, run: _Run, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the run's comm tasks and, once started, its runner thread."""
        with run.cancel:
            async with trio.open_nursery() as nursery:
                await nursery.start(run.comm.run)
                task_status.started()
                await run.started.wait()
                end = await run.runner.run()
                run.end = end
                self._finished(run, end)
                nursery.cancel_scope.cancel()
        if run.comm is not None:
            run.comm.close()

    def _finished(self, run: _Run, end: RunEnd) -> None:
        alloc = run.alloc
        if end.failed:
            logger.error("training stopped at epoch %d: %s; last completed step %d", alloc.epoch, end.reason,
                         end.completed)
        else:
            logger.info("training %s at epoch %d after step %d", end.reason, alloc.epoch, end.completed)
        self._last_end = {"epoch": alloc.epoch, "completed": end.completed, "reason": end.reason,
                          "failed": end.failed, "at": time.time(), "params_sha256": end.params_sha256}
        if self._issued is not None and self._issued.alloc.run_id == alloc.run_id and end.failed:
            self._issued.state, self._issued.reason = "stopped", end.reason

    def _reporter(self, alloc: Allocation):
        token = trio.lowlevel.current_trio_token()

        def report(rep: StepReport) -> None:  # worker thread
            token.run_sync_soon(self._send_report, alloc, rep)
        return report

    def _send_report(self, alloc: Allocation, rep: StepReport) -> None:
        if alloc.issuer == self.me:
            self._record_step(self.me, rep, alloc.run_id)
        elif self._nursery is not None:
            self._nursery.start_soon(self._send_one_way, alloc.issuer, ControlMsg.STEP,
                                     {"run": alloc.run_id, **rep.to_wire()})

    async def _send_one_way(self, peer: bytes, msg_type: int, body: dict) -> None:
        conn = self.transport.connection(peer)
        if conn is None:
            return
        try:
            await conn.send(msg_type, body)
        except ConnectionClosed:
            pass

    async def _on_start(self, conn, msg_type, body, payload) -> dict:
        run = self._run
        if not isinstance(body, dict):
            raise ProtocolError("START body must be a map")
        if run is None or body.get("run") != run.alloc.run_id or body.get("epoch") != run.alloc.epoch:
            return {"started": False, "reason": "no such epoch accepted here"}
        if conn.peer_id != run.alloc.issuer:
            return {"started": False, "reason": "only the issuer starts an epoch"}
        return self._start_local(run)

    def _start_local(self, run: _Run) -> dict:
        if run.runner is not None and not run.started.is_set():
            run.started.set()
        return {"started": True}

    async def _on_stop(self, conn, msg_type, body, payload) -> dict:
        if not isinstance(body, dict):
            raise ProtocolError("STOP body must be a map")
        run = self._run
        if run is None or body.get("run") != run.alloc.run_id:
            return {"stopped": False, "reason": "not in that run"}
        if conn.peer_id not in run.alloc.peers and conn.peer_id != run.alloc.issuer:
            return {"stopped": False, "reason": "only a peer of the run may stop it"}
        at = body.get("at_step")
        if not isinstance(at, int) or isinstance(at, bool) or at < 0:
            raise ProtocolError("STOP at_step must be a non-negative integer")
        self._stop_local(run, at)
        return {"stopped": True}

    def _stop_local(self, run: _Run, at_step: int) -> None:
        if run.runner is not None and run.started.is_set():
            run.runner.stop_at(at_step)
            logger.info("stopping the run before step %d", at_step)
        else:
            self._abort_run("stopped before it started")

    async def _on_step(self, conn, msg_type, body, payload) -> None:
        if not isinstance(body, dict):
            raise ProtocolError("STEP body must be a map")
        try:
            rep = StepReport(int(body["epoch"]), int(body["step"]),
                             None if body.get("loss") is None else float(body["loss"]),
                             float(body["iteration_s"]), float(body["compute_s"]),
                             float(body["pipeline_s"]), float(body["sync_s"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad STEP report: {e}") from None
        self._record_step(conn.peer_id, rep, body.get("run"))

    def _record_step(self, peer: bytes, rep: StepReport, run_id) -> None:
        issued = self._issued
        if issued is None or run_id != issued.alloc.run_id:
            return
        line = issued.add(peer, rep)
        if line is not None:
            issued.state = "training"
            logger.info("step %d: loss %s, %.2f s, %.0f tokens/s", line["step"],
                        "-" if line["loss"] is None else f"{line['loss']:.4f}", line["iteration_s"],
                        line["tokens_per_s"] or 0)
            if line["step"] + 1 >= issued.alloc.end_step:
                issued.state = "finished"

    def _on_member_change(self, member: Member) -> None:
        run = self._run
        if not member.state.gone or run is None:
            return
        if member.peer_id in run.alloc.peers:
            why = f"peer {member.short_id} is {member.state.name.lower()}"
            if run.comm is not None:
                run.comm.fail(member.peer_id, why)
            if not run.started.is_set():
                self._abort_run(why)
            if self._issued is not None and self._issued.alloc.run_id == run.alloc.run_id:
                self._issued.state, self._issued.reason = "stopped", why

    def _abort_run(self, reason: str) -> None:
        run = self._run
        if run is None:
            return
        if run.comm is not None:
            run.comm.abort(reason)
        if run.runner is None or not run.started.is_set():
            run.cancel.cancel()

    # ---- issuer side --------------------------------------------------------------------------

    async def start_training(self, req: TrainRequest) -> dict:
        """Schedule on the gossiped view, hand the allocation out, start every peer."""
        corpus = await self.corpus(req.data_path)
        spec = get_preset(req.preset)
        cfg = req.train or TrainConfig(seed=req.seed)
        members = {m.peer_id: m for m in self.gossip.members() if not m.state.gone}
        view = self.gossip.view()
        regions = {p: m.region for p, m in members.items()}
        if req.stages is not None and req.dp is None:
            req = replace(req, dp=max(1, len(view.peers) // req.stages))
        try:
            if req.placement == "random":
                shape = random_shape(view, spec, cfg, stages=req.stages, dp=req.dp, seed=req.seed)
            else:
                shape = await trio.to_thread.run_sync(lambda: choose_shape(
                    view, spec, cfg, stages=req.stages, dp=req.dp, regions=regions,
                    time_budget_s=self.config.schedule_time_s, seed=req.seed))
        except ValueError as e:
            raise TrainError(f"cannot schedule: {e}") from None
        epoch = 1
        alloc = Allocation(epoch=epoch, term=0, issuer=self.me, pipelines=shape.pipelines,
                           layer_ranges=shape.layer_ranges, preset=req.preset, model=spec, train=cfg,
                           data_hash=corpus.fingerprint, data_name=corpus.name, start_step=0,
                           end_step=req.steps, checkpoint_every=req.checkpoint_every,
                           predicted_iteration_s=shape.predicted_iteration_s, spares=shape.spares,
                           run_id=secrets.token_bytes(16))
        signed = SignedAllocation.sign(alloc, self.identity)
        self._issued = _Issued(alloc, self.data_dir / "train.jsonl")
        self._issued.log_path.unlink(missing_ok=True)
        targets = list(alloc.peers) + list(alloc.spares)
        logger.info("issuing epoch %d: %d stages x %d pipelines over %d peers, predicted %.3f s per step",
                    epoch, alloc.stages, alloc.dp, len(alloc.peers), alloc.predicted_iteration_s)
        answers = await self._ask_all(targets, ControlMsg.ALLOCATION, signed.to_wire(),
                                      self.config.accept_timeout_s, local=lambda: self.accept(alloc))
        refused = {p: a for p, a in answers.items() if not a.get("accepted")}
        if refused:
            await self._ask_all([p for p in targets if p not in refused], ControlMsg.STOP,
                                {"run": alloc.run_id, "at_step": 0}, self.config.request_timeout_s,
                                local=lambda: self._stop_self(alloc, 0))
            self._issued.state = "refused"
            why = "; ".join(f"{short_id(p)}: {a.get('reason', 'no answer')}" for p, a in refused.items())
            self._issued.reason = why
            raise TrainError(f"the allocation was refused: {why}")
        started = await self._ask_all(list(alloc.peers), ControlMsg.START, {"run": alloc.run_id, "epoch": epoch},
                                      self.config.request_timeout_s, local=lambda: self._start_self(alloc))
        late = [short_id(p) for p, a in started.items() if not a.get("started")]
        if late:
            logger.warning("peers %s did not confirm the start", ", ".join(late))
        self._issued.state = "training"
        return {"run_id": alloc.run_id.hex(), "epoch": epoch, "stages": alloc.stages, "dp": alloc.dp,
                "pipelines": [[p.hex() for p in pipe] for pipe in alloc.pipelines],
                "layer_ranges": [list(r) for r in alloc.layer_ranges], "spares": [p.hex() for p in alloc.spares],
                "predicted_iteration_s": alloc.predicted_iteration_s, "objective_s": shape.objective_s,
                "placement": req.placement, "steps": req.steps, "data": corpus.name, "log": str(self._issued.log_path)}

    async def _start_self(self, alloc: Allocation) -> dict:
        run = self._run
        if run is None or run.alloc.run_id != alloc.run_id:
            return {"started": False, "reason": "not accepted here"}
        return self._start_local(run)

    async def _stop_self(self, alloc: Allocation, at_step: int) -> dict:
        run = self._run
        if run is not None and run.alloc.run_id == alloc.run_id:
            self._stop_local(run, at_step)
        return {"stopped": True}

    async def stop_training(self) -> dict:
        run = self._run
        if run is None or run.end is not None:
            raise TrainError("no training run is in progress on this peer")
        now = run.state.step if run.state is not None else run.alloc.start_step
        at = now + 2  # every peer is within one step of every other: this boundary is ahead of all
        answers = await self._ask_all(list(run.alloc.peers), ControlMsg.STOP, {"run": run.alloc.run_id, "at_step": at},
                                      self.config.request_timeout_s, local=lambda: self._stop_self(run.alloc, at))
        return {"at_step": at, "told": sum(1 for a in answers.values() if a.get("stopped"))}

    async def _ask_all(self, peers: list[bytes], msg_type: int, body: dict, timeout_s: float, *, local) -> dict:
        answers: dict[bytes, dict] = {}

        async def ask(peer: bytes) -> None:
            try:
                with trio.fail_after(timeout_s):
                    if peer == self.me:
                        answers[peer] = await local()
                        return
                    conn = self.transport.connection(peer)
                    if conn is None:
                        m = {x.peer_id: x for x in self.gossip.members()}.get(peer)
                        if m is None:
                            raise ConnectionClosed("not a member")
                        conn = await self.transport.connect(*m.address, peer_id=peer)
                    reply, _ = await conn.request(msg_type, body, timeout_s=timeout_s)
                    answers[peer] = reply if isinstance(reply, dict) else {"reason": "malformed answer"}
            except (trio.TooSlowError, RequestTimeout):
                answers[peer] = {"reason": f"no answer within {timeout_s:g} s"}
            except (ConnectionClosed, RemoteError, ProtocolError, OSError) as e:
                answers[peer] = {"reason": f"unreachable: {e}"}

        async with trio.open_nursery() as nursery:
            for p in peers:
                nursery.start_soon(ask, p)
        return answers

    # ---- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": "idle"}
        run = self._run
        if run is not None:
            a = run.alloc
            out.update({"run_id": a.run_id.hex(), "epoch": a.epoch, "issuer": a.issuer.hex(),
                        "preset": a.preset, "stages": a.stages, "dp": a.dp, "end_step": a.end_step,
                        "predicted_iteration_s": a.predicted_iteration_s})
            if self.me in a.peers:
                d, s = a.position(self.me)
                pipe = a.pipelines[d]
                out.update({"stage": s, "pipeline": d, "layers": list(a.layer_ranges[s]),
                            "prev": pipe[s - 1].hex() if s > 0 else None,
                            "next": pipe[s + 1].hex() if s + 1 < a.stages else None,
                            "dp_group": [p[s].hex() for p in a.pipelines]})
            else:
                out["role"] = "spare"
            if run.end is not None:
                out["state"] = "stopped" if run.end.failed else run.end.reason
            elif run.started.is_set():
                out["state"] = "training"
            else:
                out["state"] = "accepted"
            if run.state is not None:
                out["step"] = run.state.step - 1  # last completed
            last = run.runner.last if run.runner is not None else None
            if last is not None:
                out["last_step"] = {"step": last.step, "loss": last.loss, "iteration_s": last.iteration_s,
                                    "compute_s": last.compute_s, "pipeline_s": last.pipeline_s,
                                    "sync_s": last.sync_s}
        if self._last_end is not None:
            out["last_end"] = self._last_end
        issued = self._issued
        if issued is not None:
            out["issued"] = {"run_id": issued.alloc.run_id.hex(), "state": issued.state, "reason": issued.reason,
                             "completed": issued.completed, "end_step": issued.alloc.end_step,
                             "log": str(issued.log_path), "recent": issued.recent[-8:],
                             "started_at": issued.started_at}
        out["pid"] = os.getpid()
        return out
