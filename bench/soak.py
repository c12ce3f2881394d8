"""A soak under chaos: 8 daemons of the emulated worldwide scenario train `tiny` for a given time
while a seeded nemesis injects one fault at a time, then the run is judged as a person watching
it would judge it.

    python bench/soak.py [--minutes 30] [--seed 0] [--fault-every-s 40] [--checkpoint-every 10]

The faults, drawn by `random.Random(seed)` (the same seed, the same schedule of kinds, victims
and durations; what the swarm does in between is real time; every kind once, in a seeded order,
before any kind twice): SIGKILL of a peer then its restart
with its data dir, SIGKILL of the coordinator, both holders of one stage killed at once, a kill
during a reconfiguration (a second peer killed as the first one's reconfiguration runs), a kill
during a weight transfer (a peer killed while it fetches its stage), SIGSTOP then SIGCONT, a cut
link between two pipeline neighbours then heal, a jump of one peer's wall clock (its signed
gossip times; `emulate {"clock_jump_s"}`), and a partition of the swarm into two halves then
heal. The first fault is always both holders of a stage lost before the first checkpoint: the
swarm must roll back to its initial weights and go on.

At the end the run is stopped and judged: every step logged once in the merged train.jsonl,
every loss equal to single-process training (1e-5) where one process can start from the
swarm's own state (bench/replay.py, in a thread of its own: every 5 s, each checkpoint whose every
stage the peers wrote and whose next steps are logged is replayed in one process up to the
next checkpoint, and at the end every such checkpoint still on disk; `replay` in the JSON, and
`replay_coverage`: the share of the final log's steps whose loss a replay compared), the DP replicas of every stage identical (their parameters'
sha256), and the figures: the worst deviation of the whole run from one process trained from
the start (`worst_relative_loss_deviation`, `whole_run_within_1e-5`, `whole_run_first_step_over_1e-5`: the swarm's step and one
process's whole-batch step differ by a float32 rounding, which training amplifies over the
steps, faults or not), faults by kind, steps lost to rollbacks (from the
coordinators' rollback events), the time from each fault to the next completed step (median and
worst: the longest time without a completed step from the fault to the first step after it
was undone), each daemon process's memory (RSS) growth from a minute into its life (torch
loaded, stages built and fetched) to the soak's end, for processes measured over 2 minutes or
more (`rss_growth`: a spare that took on a stage grows by the stage), and the growth while a
process held the same kind of stage without a break (a kind: its stage, or none, or a stage named
but not held after a restart; the coordinator's role; the data set loaded or not, which a daemon
loads with its first allocation; `rss_growth_same_stage`: the largest sample
of the first and of the last 30 s of one such tenure, from 30 s after it took the kind on, at
least 2 minutes apart: what a leak would show), its open file descriptors and threads (worst);
every sample is in the run dir's health.jsonl. The daemons run with DTFM_PRELOAD=torch,scipy
(peer/runner.py): what a daemon loads on first use (torch with its first stage, scipy with the
first schedule it computes, about 35 MB, at any time in its life) is loaded at its start, so a
first use is not read as growth (`--no-preload`: as a daemon runs by default). The last line of stdout is one JSON object: faults,
faults_by_kind, steps, exact, rolled_back_steps, heal_s_median, heal_s_worst, rss_growth,
rss_growth_same_stage, max_fds, max_threads and the details.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from common import kill_swarm, print_table, read_rows, swarm, wait_for
from replay import Replay, replay

from dtfm.swarm.proc import peer_request, peer_status
from dtfm.swarm.state import PeerEntry, load_state
from dtfm.swarm.train import stop_training, sync_logs
from dtfm.train import TrainConfig, get_preset, load_corpus, reference_state, reference_step

KINDS = ("kill", "kill_coordinator", "kill_stage_holders", "kill_during_reconfiguration", "kill_during_transfer",
         "freeze", "cut_link", "clock_jump", "partition_halves")
HEAL_TIMEOUT_S = 300.0  # a fault the swarm does not heal from within this is reported as such
WARM_S = 60.0  # a daemon process's memory is measured from this long after its first sample
SETTLE_S = 30.0  # ... and, within one kind of stage, from this long after it took that kind on
MIN_SPAN_S = 120.0  # ... over at least this long
WINDOW_S = 30.0  # ... as the largest sample of its first and of its last this long
REL = 1e-5
REPLAY_EVERY_S = 5.0  # how often the checkpoints not yet replayed are replayed in one process (the
# daemons keep the newest 3 per stage: a checkpoint lives about 3 checkpoint intervals)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Soak:
    def __init__(self, run_dir: Path, rng: random.Random, args: argparse.Namespace):
        self.run_dir, self.rng, self.args = run_dir, rng, args
        self.faults: list[dict] = []
        self.samples: dict[tuple[str, int], list[tuple[float, int, int, int]]] = {}  # (peer, pid) -> (t, rss, fds, thr)
        # (peer, pid) -> (t, rss, what it held then: ((stages, pipelines, its stage), or None as a
        # spare; whether it was the coordinator))
        self.held: dict[tuple[str, int], list[tuple[float, int, tuple | None]]] = {}
        self.replay = Replay()  # the checkpointed steps replayed in one process (bench/replay.py)
        self._replays_stop = threading.Event()
        self._replays = threading.Thread(target=self._replay_loop, name="replays", daemon=True)

    # ---- the swarm as seen from outside -------------------------------------------------------

    def peers(self) -> list[PeerEntry]:
        return load_state(self.run_dir).peers

    def trainings(self) -> dict[str, dict]:
        return {p.name: ((peer_status(p) or {}).get("training") or {}) for p in self.peers() if p.alive()}

    def coordinator(self) -> str | None:
        return next((n for n, t in self.trainings().items() if t.get("role") == "coordinator"), None)

    def stage_peers(self) -> dict[str, dict]:
        return {n: t for n, t in self.trainings().items() if t.get("stage") is not None}

    def _replay_loop(self) -> None:
        """Replay the checkpoints as they come (the daemons prune them), until told to stop.
        Owns `self.replay` until `judge` joins it."""
        while not self._replays_stop.wait(REPLAY_EVERY_S):
            try:
                sync_logs(self.run_dir, load_state(self.run_dir))
                replay(self.run_dir, self.replay, max_steps=self.args.checkpoint_every, say=log)
            except (OSError, ValueError, KeyError) as e:  # (a file pruned or rewritten under it: next time)
                log(f"replay deferred: {e}")

    def last_step(self) -> int:
        swarm(self.run_dir, "wait", "--step", "0")
        rows = read_rows(self.run_dir) if (self.run_dir / "train.jsonl").exists() else []
        return max((r["step"] for r in rows), default=-1)

    def heal_after(self, t0: float, undone: float, timeout_s: float) -> float | None:
        """The longest time without a completed step from the fault (`t0`) to the first step
        completed after it was undone (`undone`: the restart, the wake, the heal): the time the
        fault cost the swarm before its next step (a step in flight when it struck, completed
        just after, does not hide the stop that follows). None: no step within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                swarm(self.run_dir, "wait", "--step", "0", timeout_s=60)
            except RuntimeError:
                pass
            rows = read_rows(self.run_dir) if (self.run_dir / "train.jsonl").exists() else []
            times = sorted(r["time"] for r in rows if r.get("time", 0) > t0 and not r.get("backfilled"))
            after = [x for x in times if x > undone]
            if after:
                marks = [t0] + [x for x in times if x <= after[0]]
                return max(b - a for a, b in zip(marks, marks[1:]))
            time.sleep(1.0)
        return None

    def sample(self) -> None:
        """RSS, open fds and threads of every live daemon, from /proc."""
        now = time.monotonic()
        for p in self.peers():
            if not p.alive() or p.pid is None:
                continue
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
                fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                rss = int(fields["VmRSS"].split()[0]) * 1024
                threads = int(fields["Threads"])
                fds = len(os.listdir(f"/proc/{p.pid}/fd"))
            except (OSError, KeyError, ValueError):
                continue
            self.samples.setdefault((p.name, p.pid), []).append((now, rss, fds, threads))
            held = kind_held((peer_status(p) or {}).get("training") or {})
            self.held.setdefault((p.name, p.pid), []).append((now, rss, held))
            with open(self.run_dir / "health.jsonl", "a") as f:  # (to look at after the judgement)
                f.write(json.dumps({"t": round(now, 2), "peer": p.name, "pid": p.pid, "rss": rss, "fds": fds,
                                    "threads": threads, "held": held}) + "\n")

    # ---- faults -------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL, as `dtfm-swarm kill` sends it (at once: the first fault races the first checkpoint)."""
        pid = next(p.pid for p in self.peers() if p.name == name)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def restart(self, name: str) -> None:
        swarm(self.run_dir, "restart", name, timeout_s=120)

    def pause(self, lo: float, hi: float) -> None:
        time.sleep(self.rng.uniform(lo, hi))

    def fault(self, kind: str) -> dict:
        """Inject one fault of `kind`, undo it (restart, wake, heal); what was done."""
        rng = self.rng
        t = self.stage_peers()
        coord = self.coordinator()
        names = sorted(t)
        followers = [n for n in names if n != coord] or names
        if kind == "kill":
            victim = rng.choice(followers)
            self.kill(victim)
            self.pause(5, 20)
            self.restart(victim)
            return {"victims": [victim]}
        if kind == "kill_coordinator":
            victim = coord or rng.choice(names)
            self.kill(victim)
            self.pause(5, 20)
            self.restart(victim)
            return {"victims": [victim]}
        if kind == "kill_stage_holders":
            stage = rng.choice(sorted({v["stage"] for v in t.values()}))
            victims = sorted(n for n, v in t.items() if v["stage"] == stage)
            for v in victims:
                self.kill(v)
            self.pause(5, 20)
            for v in victims:
                self.restart(v)
            return {"victims": victims, "stage": stage}
        if kind == "kill_during_reconfiguration":
            first = rng.choice(followers)
            self.kill(first)
            second = None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and second is None:  # the reconfiguration under way
                c = self.coordinator()
                issued = (self.trainings().get(c or "", {}) or {}).get("issued") or {}
                if issued.get("state") in ("stopping", "planning", "offering", "handing out"):
                    others = [n for n in followers if n != first]
                    second = rng.choice(others) if others else None
                else:
                    time.sleep(0.3)
            if second is not None:
                self.kill(second)
            self.pause(5, 15)
            for v in (first, second):
                if v is not None:
                    self.restart(v)
            return {"victims": [v for v in (first, second) if v is not None]}
        if kind == "kill_during_transfer":
            # a stage holder killed: its stage goes to a spare or another peer, which fetches it
            # from the holders; that peer is killed while it builds (fetches) its stage
            victim = rng.choice(followers)
            self.kill(victim)
            fetching = None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and fetching is None:
                building = [n for n, v in self.trainings().items() if v.get("state") == "building"]
                fetching = rng.choice(sorted(building)) if building else None
            if fetching is not None:
                self.kill(fetching)
            self.pause(3, 8)
            for v in (victim, fetching):
                if v is not None:
                    self.restart(v)
            return {"victims": [victim] + ([fetching] if fetching else []), "during_transfer": fetching is not None}
        if kind == "freeze":
            victim = rng.choice(followers)
            pid = next(p.pid for p in self.peers() if p.name == victim)
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                self.pause(10, 30)
            finally:
                os.kill(pid, signal.SIGCONT)
            return {"victims": [victim]}
        if kind == "cut_link":
            pairs = [(a, b) for a, va in t.items() for b, vb in t.items()
                     if va.get("pipeline") == vb.get("pipeline") and vb.get("stage") == va.get("stage", -9) + 1]
            if pairs:
                a, b = rng.choice(sorted(pairs))
            else:  # (one stage, one pipeline: no neighbours; a stage peer and another live peer)
                alive = sorted(p.name for p in self.peers() if p.alive())
                a = rng.choice(names or alive)
                b = rng.choice([n for n in alive if n != a])
            swarm(self.run_dir, "partition", a, b)
            try:
                self.pause(10, 30)
            finally:
                swarm(self.run_dir, "heal")
            return {"victims": [a, b]}
        if kind == "clock_jump":
            victim = rng.choice(names)
            jump = rng.choice((-1, 1)) * rng.uniform(60, 3600)
            peer = next(p for p in self.peers() if p.name == victim)
            peer_request(peer, "emulate", {"clock_jump_s": jump})
            self.pause(10, 30)
            peer_request(peer, "emulate", {"clock_jump_s": 0.0})
            return {"victims": [victim], "jump_s": round(jump, 1)}
        if kind == "partition_halves":
            peers = [p for p in self.peers() if p.alive() and p.peer_id]
            rng.shuffle(peers)
            half = len(peers) // 2
            a, b = peers[:half], peers[half:]
            for side, other in ((a, b), (b, a)):
                for p in side:
                    peer_request(p, "emulate", {"cut": [q.peer_id for q in other]})
            try:
                self.pause(15, 40)
            finally:
                swarm(self.run_dir, "heal")
            return {"victims": sorted(p.name for p in a), "other_half": sorted(p.name for p in b)}
        raise ValueError(kind)

    def inject(self, kind: str) -> None:
        t0 = time.time()
        log(f"fault {len(self.faults) + 1}: {kind}")
        done = self.fault(kind)
        heal = self.heal_after(t0, time.time(), HEAL_TIMEOUT_S)
        rows = read_rows(self.run_dir) if (self.run_dir / "train.jsonl").exists() else []
        at = max((r["step"] for r in rows if r.get("time", 0) <= t0), default=-1)  # the last step before it
        self.faults.append({"kind": kind, "at": t0, "heal_s": None if heal is None else round(heal, 2),
                            "step_at_fault": at, **done})
        log(f"  {done} -> longest time without a step: {heal if heal is None else round(heal, 1)} s")

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> dict:
        a = self.args
        shape = () if a.shape == "auto" else ("--stages", a.shape.split("x")[0], "--dp", a.shape.split("x")[1])
        swarm(self.run_dir, "train", "--steps", "1000000", "--checkpoint-every", str(a.checkpoint_every),
              "--seed", str(a.run_seed), *shape)
        swarm(self.run_dir, "wait", "--step", "1", "--timeout", "600")
        self._replays.start()
        end = time.monotonic() + 60 * a.minutes
        # both holders of a stage lost before the first checkpoint: a rollback to the initial weights
        self.inject("kill_stage_holders")
        self.faults[0]["before_first_checkpoint"] = self.faults[0]["step_at_fault"] + 1 < a.checkpoint_every
        self.sample()
        deck: list[str] = []
        while time.monotonic() < end:
            wait = min(self.rng.uniform(0.5, 1.5) * a.fault_every_s, max(0.0, end - time.monotonic()))
            slept = 0.0
            while slept < wait:
                time.sleep(min(5.0, wait - slept))
                slept += 5.0
                self.sample()
            if time.monotonic() >= end:
                break
            if not deck:  # every kind once, in a seeded order, before any twice
                deck = list(KINDS)
                self.rng.shuffle(deck)
            self.inject(deck.pop())
            self.sample()
            if self.faults[-1]["heal_s"] is None:
                log("the swarm did not heal: the nemesis stops")
                break
        self.sample()
        return self.judge()

    def judge(self) -> dict:
        coord_name = wait_for("a coordinator", self.coordinator, 120)
        peer = next(p for p in self.peers() if p.name == coord_name)
        stop_training(self.run_dir, peer)

        def ended():
            """The run is over at its coordinator and every stage peer of its last epoch ended it."""
            t = self.trainings()
            issued = [v.get("issued") or {} for v in t.values() if v.get("role") == "coordinator"]
            if not issued or issued[0].get("state") != "stopped":
                return None
            epoch = issued[0].get("epoch")
            stages = {n: v for n, v in t.items() if v.get("stage") is not None and v.get("epoch") == epoch}
            done = all((v.get("last_end") or {}).get("epoch") == epoch and v.get("state") not in ("training", "stopping")
                       for v in stages.values())
            return stages if stages and done else None
        ends = wait_for("the run to stop on every stage peer", ended, 300)
        groups: dict[int, set[str]] = {}
        for v in ends.values():
            groups.setdefault(v["stage"], set()).add(v["last_end"]["params_sha256"])
        replicas_identical = all(len(h) == 1 for h in groups.values())
        swarm(self.run_dir, "wait", "--step", "0")
        rows = read_rows(self.run_dir)
        steps = [r["step"] for r in rows]
        once = steps == list(range(len(steps)))
        state, corpus = reference_state(get_preset("tiny"), TrainConfig(seed=self.args.run_seed)), load_corpus()
        # as tests/swarms.py's check_log: within 1e-5 of the loss, relative or absolute (a new DP
        # degree changes the float32 summation order; the differences grow over the steps)
        worst = worst_abs = 0.0
        within, first_over = True, None
        for r in rows:
            ref = reference_step(state, corpus)
            if r["loss"] is None:
                within = False
                continue
            diff = abs(r["loss"] - ref)
            worst, worst_abs = max(worst, diff / max(abs(ref), 1e-12)), max(worst_abs, diff)
            if diff > max(REL * abs(ref), REL) and first_over is None:
                first_over = r["step"]
            within = within and diff <= max(REL * abs(ref), REL)
        self._replays_stop.set()
        self._replays.join()
        replay(self.run_dir, self.replay, max_steps=self.args.checkpoint_every, say=log)
        replayed = self.replay.to_dict(rows)
        events = [json.loads(x) for x in (self.run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
        rollbacks = [e for e in events if e.get("event") == "rollback"]
        rolled_back = sum(int(e.get("steps_lost") or 0) for e in rollbacks)
        heals = [f["heal_s"] for f in self.faults if f["heal_s"] is not None]
        growth, fds, threads, rss_mb = self.health()
        in_kind, in_kind_worst = self.growth_in_kind()
        return {
            "faults": len(self.faults), "faults_by_kind": dict(sorted(Counter(f["kind"] for f in self.faults).items())),
            "steps": len(rows), "exact": bool(once and replicas_identical and replayed["exact"]),
            "replay": replayed, "replay_coverage": replayed["coverage"], "whole_run_within_1e-5": within, "whole_run_first_step_over_1e-5": first_over,
            "rolled_back_steps": rolled_back, "rollbacks": len(rollbacks),
            "rollback_sources": dict(Counter(str(e.get("restored_from")) for e in rollbacks)),
            "heal_s_median": round(statistics.median(heals), 2) if heals else None,
            "heal_s_worst": round(max(heals), 2) if heals else None,
            "unhealed": sum(f["heal_s"] is None for f in self.faults),
            "rss_growth": growth, "rss_mb_first_last": rss_mb,
            "rss_growth_same_stage": in_kind, "rss_growth_same_stage_worst": in_kind_worst, "max_fds": fds, "max_threads": threads,
            "every_step_once": once, "replicas_identical": replicas_identical,
            "worst_relative_loss_deviation": worst, "worst_absolute_loss_deviation": worst_abs, "minutes": self.args.minutes, "seed": self.args.seed,
            "reconfigurations": sum(e.get("event") in ("reconfigure", "rollback", "leave") for e in events),
            "fault_log": [{k: v for k, v in f.items() if k != "at"} for f in self.faults],
        }

    def health(self) -> tuple[float | None, int, int, dict[str, list[int]]]:
        """The worst RSS growth of a daemon process, from its first sample once it has lived
        WARM_S (torch loaded, a stage built and fetched; a restarted daemon is a new process) to
        its last, among processes sampled over at least MIN_SPAN_S after that; the most open fds
        and threads any daemon had; and each measured process's first and last RSS in MB."""
        growth, shown = None, {}
        for (name, pid), series in sorted(self.samples.items()):
            late = [x for x in series if x[0] >= series[0][0] + WARM_S]
            if len(late) < 2 or late[-1][0] - late[0][0] < MIN_SPAN_S:
                continue
            g = late[-1][1] / late[0][1] - 1
            growth = g if growth is None else max(growth, g)
            shown[f"{name}/{pid}"] = [late[0][1] >> 20, late[-1][1] >> 20]
        fds = max((x[2] for s in self.samples.values() for x in s), default=0)
        threads = max((x[3] for s in self.samples.values() for x in s), default=0)
        return (None if growth is None else round(growth, 4)), fds, threads, shown

    def growth_in_kind(self) -> tuple[float | None, dict[str, list]]:
        """The worst RSS growth of a daemon process within one tenure: a stretch of samples in
        which it held one kind of stage without a break (stages, pipelines, its stage; a spare is
        a kind too; so is the coordinator's role, which loads the scheduler), from SETTLE_S after it took that kind on to the tenure's last sample, over
        at least MIN_SPAN_S (a bigger stage, more activations, or torch and a stage's leftovers
        in a spare that held a stage before are not a leak; memory that grows while the process
        holds what it held is); and the worst case's process and MB."""
        worst: float | None = None
        shown: dict[str, list] = {}
        for (name, pid), series in sorted(self.held.items()):
            tenures: list[tuple[object, list[tuple[float, int]]]] = []
            start = 0.0
            for t, rss, kind in series:
                if not tenures or tenures[-1][0] != kind:
                    tenures.append((kind, []))
                    start = t
                if t - start >= SETTLE_S:
                    tenures[-1][1].append((t, rss))
            for kind, settled in tenures:
                if not settled or settled[-1][0] - settled[0][0] < MIN_SPAN_S:
                    continue
                t0, t1 = settled[0][0], settled[-1][0]
                # the largest sample of the tenure's first and last WINDOW_S: a sample that lands on
                # a step's activations and one between steps differ by more than a leak would
                r0 = max(r for t, r in settled if t <= t0 + WINDOW_S)
                r1 = max(r for t, r in settled if t >= t1 - WINDOW_S)
                g = r1 / r0 - 1
                if worst is None or g > worst:
                    worst = g
                    shown = {f"{name}/{pid}": [str(kind), r0 >> 20, r1 >> 20, round(t1 - t0)]}
        return (None if worst is None else round(worst, 4)), shown


def kind_held(training: dict) -> tuple:
    """What a daemon holds, from its status's `training`, as the memory judgement tells tenures
    apart: its stage ((stages, pipelines, its stage), None as a spare; "restored" for a daemon
    restarted into the allocation it applied before, whose stage it names but does not hold until
    an epoch places it), whether it is the coordinator (which loads the scheduler, scipy, once
    it schedules) and whether it loaded the data set (about 30 MB of the standard library's
    source by default, loaded with a daemon's first allocation, spare or not)."""
    stage = training.get("stage")
    coordinator, data = training.get("role") == "coordinator", bool(training.get("data_bytes"))
    if stage is not None and training.get("restored"):
        return "restored", coordinator, data
    return ((training.get("stages"), training.get("dp"), stage) if stage is not None else None, coordinator, data)


def _shape(text: str) -> str:
    if text == "auto":
        return text
    s, _, d = text.partition("x")
    if not (s.isdigit() and d.isdigit() and int(s) >= 1 and int(d) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is STAGESxPIPELINES (e.g. 2x2) or auto")
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the nemesis runs (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="the nemesis' seed (default: %(default)s)")
    ap.add_argument("--run-seed", type=int, default=0, help="the training run's seed (default: %(default)s)")
    ap.add_argument("--peers", type=int, default=8, help="daemons (default: %(default)s)")
    ap.add_argument("--fault-every-s", type=float, default=40.0,
                    help="mean seconds of quiet training between faults (default: %(default)s)")
    ap.add_argument("--shape", default="2x2", type=_shape,
                    help="the run's first shape, STAGESxPIPELINES, or auto for the scheduler's (on one machine it "
                         "puts `tiny` on one peer: no pipeline, no DP group to heal) (default: %(default)s)")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="the run's --checkpoint-every (default: %(default)s)")
    ap.add_argument("--run-dir", type=Path, default=None,
                    help="the swarm's run dir, kept afterwards (default: a temporary one, removed)")
    ap.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                    help="one more `dtfm-swarm up` argument, repeatable (e.g. --up-arg=--plane-profile --up-arg=wan)")
    ap.add_argument("--no-preload", action="store_true",
                    help="start the daemons without DTFM_PRELOAD=torch,scipy (see above)")
    args = ap.parse_args(argv)
    if not args.no_preload:
        os.environ["DTFM_PRELOAD"] = "torch,scipy"  # (dtfm-swarm up passes its environment to the daemons)
    torch.set_num_threads(1)  # (the replays share the machine's cores with the daemons)
    rng = random.Random(args.seed)
    tmp = None
    if args.run_dir is None:
        tmp = tempfile.mkdtemp(prefix="dtfm-soak-")
        run_dir = Path(tmp) / "swarm"
    else:
        run_dir = args.run_dir
    swarm(run_dir, "up", "--fresh", "--scenario", "worldwide", "--peers", str(args.peers), "--timeout", "300",
          *args.up_arg, timeout_s=900)
    try:
        result = Soak(run_dir, rng, args).run()
    finally:
        kill_swarm(run_dir)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(["fault", "kind", "victims", "longest time without a step (s)"],
                [(i + 1, f["kind"], " ".join(f["victims"]), f["heal_s"]) for i, f in enumerate(result["fault_log"])])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
