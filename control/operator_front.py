"""The operator's front on one daemon: the signed operations an operator's CLI hands this
peer over its control socket (`train start`, `stop`, `reschedule`, `resume`, `council`,
`export`, `train status`), those a peer forwards to its coordinator (TRAIN_OP), and a peer's
planned leave (LEAVE). It checks each operation's signature, finds or elects the coordinator,
forwards what is not for this peer, and hands the rest to the coordinator machine through the
shell (control/plane.py's `coordinator_request`), which owns the machines and the IO.

`ControlPlane.operator` is this peer's front; peer/services.py calls it.
"""

from __future__ import annotations

import collections.abc
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from dtfm.files import atomic_write
from dtfm.gossip import GossipService
from dtfm.net import PeerConnection, PeerTransport, ProtocolError, short_id
from dtfm.train import Corpus, GPTSpec

from . import inputs
from .config import PlaneConfig
from .coordinator.machine import Coordinator, PeerLeaving, Reschedule, ResumeRun, StartRun, StopRun, first_council
from .coordinator.phase import run_over, run_word
from .coordinator.request import TrainError, TrainRequest
from .election import Council, ElectionService
from .epoch.machine import EpochMachine
from .events import Reconfiguration
from .loading import import_in_thread
from .messages import ControlMsg
from .models import HeldModel, model_refusal
from .operator import OperatorError, SignedOp, check_op, check_time, council_arg, root_council
from .planner import GossipSwarm
from .progress import RunProgress, run_progress

if TYPE_CHECKING:  # (torch: loaded with the first stage, offer or export)
    from .epoch.stages import StageHost
    from .export import ExportProgress

__all__ = ["ROOT_NAME", "OperatorFront", "Shell", "load_root", "save_root"]

ROOT_NAME = "council.bin"  # the council an operator's operation rooted here, before any allocation carried it
FIND_AGAIN_ELECTIONS = 4  # `train start` without a coordinator asks the peers again after this many election timeouts
logger = logging.getLogger(__name__)


def load_root(data_dir: Path) -> Council | None:
    """The council an operator's operation rooted here (`council.bin`), if any."""
    path = data_dir / ROOT_NAME
    try:
        return Council.decode(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ProtocolError) as e:
        raise TrainError(f"{path} is damaged ({e}): move it away; the operator's next start or "
                         "`train council` roots the council again") from None


def save_root(data_dir: Path, council: Council) -> None:
    atomic_write(data_dir / ROOT_NAME, council.encode())


class Shell(Protocol):
    """What the front needs of the daemon's shell (control/plane.py's `ControlPlane`)."""

    @property
    def me(self) -> bytes: ...
    @property
    def data_dir(self) -> Path: ...
    @property
    def config(self) -> PlaneConfig: ...
    @property
    def operators(self) -> frozenset[bytes]: ...
    @property
    def election(self) -> ElectionService: ...
    @property
    def coordinator(self) -> Coordinator: ...
    @property
    def epoch(self) -> EpochMachine: ...
    @property
    def gossip(self) -> GossipService: ...
    @property
    def transport(self) -> PeerTransport: ...
    @property
    def reconfigurations(self) -> collections.abc.Sequence[Reconfiguration]: ...

    async def ask_all(self, peers: Iterable[bytes], msg_type: int, body: dict, timeout_s: float) -> dict: ...
    async def coordinator_request(self, event_type: Any, *args: Any) -> Any: ...
    async def corpus(self) -> Corpus: ...
    async def models(self) -> dict[str, HeldModel]: ...
    async def host(self) -> StageHost: ...
    def address_of(self, peer: bytes) -> tuple[str, int] | None: ...
    def link_rate(self, peer: bytes) -> float | None: ...
    def run_log_path(self, run_hex: str) -> Path: ...
    def export_tokenizer(self, spec: GPTSpec) -> Path | None: ...


class OperatorFront:
    """One daemon's operator front (see the module docstring)."""

    def __init__(self, plane: Shell):
        self.plane = plane
        self.me, self.config, self.operators = plane.me, plane.config, plane.operators
        self.election, self.coordinator, self.epoch, self.gossip = (plane.election, plane.coordinator, plane.epoch,
                                                                    plane.gossip)
        self.swarm_wait: dict | None = None  # while `train start --min-peers` waits: have / want / live
        self.export_progress: ExportProgress | None = None  # the export running here (`dtfm-peer export`)

    def take_root(self, signed: SignedOp) -> Council:
        """The council an operator's fresh start or council operation roots, taken here (a
        start's only by a peer without a council; a council operation's over an older root):
        TrainError when it is no operator's, names no council or is not fresh."""
        try:
            council = root_council(signed, self.operators)
            check_time(signed.open(), time.time(), self.config.operator_skew_s)
        except (OperatorError, ProtocolError) as e:
            raise TrainError(str(e)) from None
        rerooting = signed.open().kind == "council"
        if self.election.council is None or rerooting:
            self.election.set_root(council, rerooting=rerooting)
            if self.election.council is council:
                save_root(self.plane.data_dir, council)
        return council

    async def _send_root(self, peers: Iterable[bytes], signed: SignedOp) -> int:
        """Hand an operator's root to `peers` (TRAIN_OP `root`); how many took it."""
        peers = [p for p in peers if p != self.me]
        if not peers:
            return 0
        answers = await self.plane.ask_all(peers, ControlMsg.TRAIN_OP, {"op": "root", "signed": signed.to_wire()},
                                      self.config.request_timeout_s)
        return sum(1 for a in answers.values() if isinstance(a.get("ok"), dict))

    async def start_training(self, signed: SignedOp, *, forwarded: bool = False) -> dict:
        """An operator's signed start: wait for its `min_peers` live, measured peers; stand for
        coordinator if there is none; the coordinator schedules on the gossiped view, hands the
        allocation out and starts every peer. A start that no operator of the swarm signed is
        refused first, before any wait or work."""
        try:
            req = check_op(signed, "start", self.operators).request()
        except (OperatorError, ValueError) as e:
            raise TrainError(str(e)) from None
        if not forwarded:  # (a forwarding peer has waited)
            await self._await_swarm(req.min_peers, req.wait_s)
        coordinator = self.me if forwarded else await self._become_coordinator(signed)
        term = self.election.term
        try:
            if coordinator != self.me:
                return await self._forward(coordinator, "start", signed)
            return await self._start_here(req, signed)
        except TrainError as e:
            now = self.election.term
            if e.deposed or now <= term:
                raise
            raise TrainError(f"{e} (the coordinator of term {term} was replaced in term {now} while it handed the "
                             "run out)", deposed=True) from None

    async def _start_here(self, req: TrainRequest, signed: SignedOp) -> dict:
        """The start on this peer, the coordinator: checked against its data set and models,
        scheduled, handed out; the allocation as the operator sees it."""
        refusal = self.coordinator.start_refusal()  # (cheap, before this peer's data set is loaded)
        if refusal is not None:
            raise TrainError(refusal)
        corpus = await self.plane.corpus()
        models = await self.plane.models()
        refusal = model_refusal(req.preset, req.init_from, req.init_name, models)
        if refusal is not None:
            raise TrainError(refusal)
        model = models[req.preset].spec if req.init_from is not None else None
        req.check_data(corpus, model)
        alloc = await self.plane.coordinator_request(StartRun, signed, corpus.fingerprint, corpus.name, model)
        return {"run_id": alloc.run_id.hex(), "epoch": alloc.epoch, "term": alloc.term, "stages": alloc.stages,
                "dp": alloc.dp, "coordinator": self.me.hex(),
                "pipelines": [[p.hex() for p in pipe] for pipe in alloc.pipelines],
                "layer_ranges": [list(r) for r in alloc.layer_ranges], "spares": [p.hex() for p in alloc.spares],
                "predicted_iteration_s": alloc.predicted_iteration_s, "placement": req.placement,
                "shape_note": self.coordinator.shape_note,
                "steps": req.steps, "data": corpus.name, "log": str(self.plane.run_log_path(alloc.run_id.hex())),
                "compression": alloc.compression.to_spec(), "model": alloc.preset,
                "train": alloc.train.to_dict(), "init_from": req.init_from,
                **({} if alloc.compress_links is None else {  # a per-link run: which links and groups compress
                    "compress_links": {"pp": [list(r) for r in alloc.compress_links.pp],
                                       "dp": list(alloc.compress_links.dp),
                                       "text": alloc.compress_links.describe(alloc.compression)}})}

    async def _await_swarm(self, min_peers: int, wait_s: float) -> None:
        """Return once `min_peers` peers (this one included) are live and their links measured,
        so the first placement is the swarm the operator expects; TrainError after `wait_s`.
        The count is in `status()` while it waits."""
        deadline = trio.current_time() + wait_s
        said = -1
        swarm = GossipSwarm(self.gossip, self.me)
        try:
            while True:
                live = set(self.gossip.live_peers()) | {self.me}
                view, _ = swarm.measured_view(live)
                have = len(view.peers)
                self.swarm_wait = {"have": have, "want": min_peers, "live": len(live)}
                if have >= min_peers:
                    return
                if have != said:
                    logger.info("train start waits for %d peers: %d live, %d of them measured",
                                min_peers, len(live), have)
                    said = have
                left = deadline - trio.current_time()
                if left <= 0:
                    raise TrainError(f"only {have} of the {min_peers} peers asked for (--min-peers) are "
                                     f"live and measured after {wait_s:g} s ({len(live)} live): "
                                     "are the others started, with this swarm's bootstrap address?")
                await trio.sleep(min(self.config.swarm_poll_s, left))
        finally:
            self.swarm_wait = None

    async def _become_coordinator(self, start: SignedOp) -> bytes:
        """The coordinator: the one this peer follows, else one found by asking the live peers
        (election/discovery.py) and verified against this peer's council, else one elected by
        the council (this peer stands where it is a voter). A swarm without a council takes the
        one the operator's `start` names: this peer roots it and hands the root to its voters.
        Raises TrainError saying why after elect_timeout_s (who holds a lease, how many voters
        answer)."""
        if self.election.is_coordinator:
            return self.me
        if self.election.coordinator is not None:
            return self.election.coordinator
        deadline = trio.current_time() + self.config.elect_timeout_s
        ask_s = min(self.config.request_timeout_s, self.config.elect_timeout_s)
        found = await self.election.find_coordinator(self.gossip.live_peers(), ask_s)
        root: Council | None = None
        # (Peers that say they have a council are only a hint: the claim is unchecked, so it
        # never keeps the operator's start from rooting one here.)
        hint = "" if self.election.council is not None or not found.configured else (
            f"; {found.configured} live peer(s) say they have a council: if the swarm has one, start the run on "
            "a peer of it (`dtfm-peer status` shows the voters), or re-root it with `dtfm-peer train council`")
        if found.coordinator is None and self.election.council is None:
            try:
                root = self.take_root(start)
            except TrainError as e:
                raise TrainError(f"this peer has no council yet, and {e}{hint}") from None
        while found.coordinator is None:
            if root is not None:
                await self._send_root(root.voters, start)
            self.election.campaign()  # stands if it is a voter of its council
            left = deadline - trio.current_time()
            if left <= 0:
                raise TrainError(f"no coordinator was elected within {self.config.elect_timeout_s:g} s: "
                                 f"{found.why}{hint}")
            c = await self.election.wait_for_coordinator(min(left, FIND_AGAIN_ELECTIONS
                                                             * self.config.election.election_timeout_max_s))
            if c is not None:
                return c
            found = await self.election.find_coordinator(self.gossip.live_peers(), ask_s)
        return found.coordinator

    async def stop_training(self, signed: SignedOp) -> dict:
        """An operator's signed stop, on any peer: the coordinator tells every peer of the run
        to end before the same step, and the run is over (nobody reconfigures it)."""
        cur = self.epoch.current
        if cur is None or self._run_over():
            raise TrainError("no training run is in progress on this peer")
        try:
            check_op(signed, "stop", self.operators, run_id=cur.run_id)
        except OperatorError as e:
            raise TrainError(str(e)) from None
        return await self._on_coordinator("stop", signed, StopRun)

    def _run_over(self) -> bool:
        return run_over(self.epoch.status(), self.coordinator.status())

    async def reschedule(self, signed: SignedOp) -> dict:
        """An operator's signed reschedule, on any peer: a new allocation now, on the coordinator."""
        try:
            check_op(signed, "reschedule", self.operators)
        except OperatorError as e:
            raise TrainError(str(e)) from None
        return await self._on_coordinator("reschedule", signed, Reschedule)

    async def resume_training(self, signed: SignedOp) -> dict:
        """An operator's signed resume of a stopped run, on any peer: the coordinator brings it
        back as a new epoch from the newest step every stage is held at (docs/control.md)."""
        try:
            check_op(signed, "resume", self.operators)
        except OperatorError as e:
            raise TrainError(str(e)) from None
        return await self._on_coordinator("resume", signed, ResumeRun)

    async def _known_coordinator(self) -> bytes:
        """The coordinator this peer recognises, else the one the live peers name
        (election/discovery.py); TrainError with why none is found."""
        c = self.election.coordinator
        if c is None:
            found = await self.election.find_coordinator(self.gossip.live_peers(), self.config.request_timeout_s)
            if found.coordinator is None:
                raise TrainError(f"no coordinator is known: {found.why}")
            c = found.coordinator
        return c

    async def _on_coordinator(self, op: str, signed: SignedOp, event_type: type[StopRun | Reschedule | ResumeRun], *,
                              forwarded: bool = False) -> dict:
        """Feed an operator's stop or reschedule to the coordinator machine here, or forward it to
        the coordinator this peer knows."""
        if not self.election.is_coordinator:
            if forwarded:
                raise TrainError("this peer is no longer the coordinator")
            return await self._forward(await self._known_coordinator(), op, signed)
        return await self.plane.coordinator_request(event_type, signed)

    async def on_train_op(self, conn: PeerConnection, msg_type: int, body: object,
                          payload: memoryview | None) -> dict:
        """An operator's start, stop, reschedule or resume forwarded by a peer: the signed operation and
        nothing else (no path, no unsigned argument); refused before any work unless an operator
        of the swarm signed it (the machine checks the rest)."""
        forwarded = inputs.train_op(body)
        op, signed = forwarded.op, forwarded.signed
        if signed is None:
            return {"error": f"a {op} must carry the operator's signed operation (run the same dtfm version)"}
        if op == "root":  # an operator's start or council operation naming a council: its voters' root
            try:
                council = self.take_root(signed)
            except TrainError as e:
                logger.warning("refused a council root from %s: %s", conn.short_id, e)
                return {"error": str(e)}
            return {"ok": {"voters": len(council.voters), "taken": self.election.council is council}}
        try:
            check_op(signed, op, self.operators)
        except OperatorError as e:
            logger.warning("refused a forwarded train %s from %s: %s", op, conn.short_id, e)
            return {"error": str(e)}
        if not self.election.is_coordinator:
            c = self.election.coordinator
            return {"error": f"this peer is not the coordinator ({short_id(c) if c else 'none known'})"}
        try:
            if op == "start":
                return {"ok": await self.start_training(signed, forwarded=True)}
            if op == "stop":
                return {"ok": await self._on_coordinator(op, signed, StopRun, forwarded=True)}
            if op == "resume":
                return {"ok": await self._on_coordinator(op, signed, ResumeRun, forwarded=True)}
            return {"ok": await self._on_coordinator(op, signed, Reschedule, forwarded=True)}
        except TrainError as e:
            return {"error": str(e), **({"deposed": True} if e.deposed else {})}

    async def _forward(self, coordinator: bytes, op: str, signed: SignedOp) -> dict:
        answers = await self.plane.ask_all([coordinator], ControlMsg.TRAIN_OP, {"op": op, "signed": signed.to_wire()},
                                      self.config.forward_timeout_s)
        a = answers[coordinator]
        if "ok" in a and isinstance(a["ok"], dict):
            return a["ok"]
        # ("deposed" only has the operator sign the operation again, a bounded number of times)
        raise TrainError(f"the coordinator {short_id(coordinator)}: {a.get('error') or a.get('reason')}",
                         deposed=a.get("deposed") is True)

    async def hand_off(self) -> str | None:
        """Before a planned leave: tell the coordinator, which reconfigures the run without
        this peer at a step boundary (its stages offered from memory) and answers once the new
        epoch runs; None when done or there was nothing to hand off, else why not (bounded by
        leave_hand_off_s)."""
        target, why = self.epoch.hand_off_to()
        if target is None:
            return why or None
        timeout_s = self.config.leave_hand_off_s
        if target == self.me:
            with trio.move_on_after(timeout_s):
                a = await self._leave_asked(self.me)
                return a.get("error")
            return f"the hand-off took longer than {timeout_s:g} s"
        logger.info("asking the coordinator %s to hand this peer's part off", short_id(target))
        a = (await self.plane.ask_all([target], ControlMsg.LEAVE, {}, timeout_s))[target]
        return None if isinstance(a.get("ok"), dict) else f"the coordinator {short_id(target)}: " + str(
            a.get("error") or a.get("reason"))

    async def on_leave(self, conn: PeerConnection, msg_type: int, body: object,
                       payload: memoryview | None) -> dict:
        """A peer's own planned leave (the sender is the authenticated peer of the connection:
        no peer announces another's leave)."""
        inputs.leave_request(body)
        with trio.move_on_after(self.config.leave_hand_off_s):
            return await self._leave_asked(conn.peer_id)
        return {"error": f"the hand-off took longer than {self.config.leave_hand_off_s:g} s"}

    async def _leave_asked(self, peer: bytes) -> dict:
        try:
            return {"ok": await self.plane.coordinator_request(PeerLeaving, peer)}
        except TrainError as e:
            return {"error": str(e)}

    async def export(self, signed: SignedOp, out_dir: Path, *, overwrite: bool = False) -> dict:
        """An operator's signed export naming this peer: gather the run's stages from their
        holders and write one Hugging Face folder at `out_dir` (control/export.py)."""
        try:
            op = check_op(signed, "export", self.operators)
            if op.exporter() != self.me:
                raise OperatorError(f"the export names peer {short_id(op.exporter())}, not this one")
        except (OperatorError, ValueError) as e:
            raise TrainError(str(e)) from None
        if self.export_progress is not None and self.export_progress.phase not in ("done", "failed"):
            raise TrainError(f"an export of run {self.export_progress.run} is running here: wait for it")
        await import_in_thread("dtfm.control.export")
        from .export import ExportError, ExportProgress, export_run  # (torch: the stages are tensors)

        progress = self.export_progress = ExportProgress(op.run_id.hex()[:8])
        try:
            return await export_run(
                signed, op.run_id, out_dir, me=self.me, peers=set(self.gossip.live_peers()) | {self.me},
                ask=lambda peers, body, t: self.plane.ask_all(peers, ControlMsg.RUN_STATE, body, t),
                stages=await self.plane.host(), transport=self.plane.transport, address_of=self.plane.address_of,
                rate_of=self.plane.link_rate, timeout_s=self.config.accept_timeout_s, progress=progress, overwrite=overwrite,
                tokenizer_for=self.plane.export_tokenizer)
        except ExportError as e:
            progress.phase = "failed"
            raise TrainError(str(e)) from None
        finally:
            if progress.phase != "done":
                progress.phase = "failed"

    async def operator_info(self, *, wait_peers: int = 0, wait_s: float = 0.0) -> dict:
        """What an operator's CLI needs to sign: the swarm's operators, the run in progress here,
        the data set this peer trains on, and the council (`council`: this peer's, else the one
        it proposes for a first start, of live measured peers spread over the regions, after
        waiting up to `wait_s` for `wait_peers` of them; `council_rooted`: which)."""
        corpus = await self.plane.corpus()
        cur = self.epoch.current
        live = cur is not None and not self._run_over()
        rooted = self.election.council is not None
        if not rooted and wait_peers > 1:
            await self._await_swarm(wait_peers, wait_s)
        council = self.election.voters if rooted else self.propose_council()
        return {"operators": sorted(p.hex() for p in self.operators), "peer_id": self.me.hex(),
                "run_id": cur.run_id.hex() if cur is not None and live else None,
                "last_run_id": cur.run_id.hex() if cur is not None else None,
                "data_hash": corpus.fingerprint, "data_name": corpus.name,
                "council": council_arg(council), "council_rooted": rooted,
                "council_size": self.config.council_size}

    def propose_council(self) -> tuple[bytes, ...]:
        """A first council: this peer and live measured peers spread over the regions, up to
        `council_size` (`first_council`)."""
        swarm = GossipSwarm(self.gossip, self.me)
        view, _ = swarm.measured_view(set(self.gossip.live_peers()) | {self.me})
        return first_council(self.me, set(view.peers), swarm.regions(), self.config.council_size)

    async def reroot(self, signed: SignedOp) -> dict:
        """An operator's signed council operation (`dtfm-peer train council`): its council
        replaces the one this peer holds (an older root's), and every live peer is handed it;
        the council then elects a coordinator. For a council that lost its quorum."""
        try:
            check_op(signed, "council", self.operators)
        except OperatorError as e:
            raise TrainError(str(e)) from None
        council = self.take_root(signed)
        if self.election.council is not council:
            raise TrainError("this peer's council was rooted by a later operation of the operator: sign again")
        told = await self._send_root(self.gossip.live_peers(), signed)
        self.election.campaign()  # stands if it is a voter of the new council
        return {"voters": [v.hex() for v in council.voters], "told": told}

    # ---- a run's progress (`dtfm-peer train status`) ---------------------------------------------

    def progress_here(self, run: bytes | None, after: int) -> dict:
        """This coordinator's account of its run (control/progress.py), or why it has none."""
        log = self.coordinator.steplog
        if not self.election.is_coordinator or log is None:
            c = self.election.coordinator
            return {"error": f"{short_id(self.me)} is not the coordinator of a run"
                             + (f" ({short_id(c)} is the coordinator)" if c is not None and c != self.me else "")}
        alloc = log.alloc
        if run is not None and run != alloc.run_id:
            return {"error": f"the coordinator's run is {alloc.run_id.hex()}, not {run.hex()}: an earlier run's "
                             f"steps are in train-{run.hex()}.jsonl in the data dir of the coordinator that "
                             "logged them"}
        st = self.coordinator.status()
        state = run_word(self.epoch.status(), st)
        return run_progress(run_id=alloc.run_id, coordinator=self.me, state=state, term=alloc.term,
                            epoch=alloc.epoch, shape=f"{alloc.stages}x{alloc.dp}", completed=log.completed + 1,
                            steps=alloc.end_step, recent=log.recent, reconfigurations=self.plane.reconfigurations,
                            after_step=after, reason=st.stalled_reason or st.reason,
                            stop_step=self.coordinator.operator_stop_step(alloc.run_id) if state == "stopped"
                            else None).to_wire()

    async def train_progress(self, run: bytes | None, after: int) -> RunProgress:
        """The run's progress from its coordinator, this peer or the one it finds (within
        request_timeout_s); TrainError with the reason when there is none to tell."""
        body = {"op": "progress", "run": run, "after": after}
        if self.election.is_coordinator:
            answer = self.progress_here(run, after)
        else:
            c = await self._known_coordinator()
            answer = (await self.plane.ask_all([c], ControlMsg.RUN_STATE, body, self.config.request_timeout_s))[c]
            if "error" not in answer and "run" not in answer:  # no answer (unreachable, timed out)
                answer = {"error": f"the coordinator {short_id(c)}: {answer['reason']}"}
        if "error" in answer:
            raise TrainError(str(answer["error"])[:512])
        try:
            return RunProgress.from_wire(answer)
        except ProtocolError as e:
            raise TrainError(f"the coordinator's answer is malformed: {e}") from None
