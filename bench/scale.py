"""dtfm at swarm sizes: real daemons on this machine, and the control plane and gossip in
simulation up to 1,000 peers, against baselines measured in the same run.

    .venv/bin/python bench/scale.py [--daemons 16,32,64] [--sim 256,1000] [--only daemons,sim,gossip,sched]

1. daemons: for each size, `dtfm-swarm up --peers N` (emulated worldwide, bandwidth scaled as
   the scripted swarms are): `up_s` (launch to every link measured), then idle for
   `--idle-s`: `idle_pss_mib` and `idle_private_mib` (median per daemon, /proc/PID/smaps_rollup)
   and `idle_cpu_cores` (the whole swarm's CPU seconds per second); `dtfm-swarm train` of
   `tiny` on the scheduler's shape (or `--stages` x `--dp`) with a global batch of one sequence
   per peer: `handout_s` (the command, from the signed start to every peer started), `shape`
   and `shape_note` (why the scheduler chose it), `step_s` (median iteration after the first
   two), then an eighth of the peers SIGKILLed at once (none the coordinator; stage holders
   first, never the last holder of a stage, nor more of the council's voters than it can lose
   and keep a quorum: one of 5): `recover_s` (kill to the first step of the next
   epoch, or to the next step when only spares died), `rolled_back` and `steps_lost` (steps run again after a rollback), and at the
   end `every_step_once` and `max_loss_rel_dev` (each logged loss against one process
   training the same steps, train/reference.py). With `--churn-s S`, after the kills: for S
   seconds, every `--churn-every` seconds a peer leaves (SIGKILL; never the coordinator, never
   the last live holder of a stage, never a voter the council cannot lose; every other time a
   stage holder) or one that left comes back (`dtfm-swarm restart`), in turn: `churn` (events, steps trained during it, rollbacks, steps lost), before the checks
   of every step. Progress goes to stderr.
   The baseline beside each: `step_s` of one process training the same steps
   (`single_process_step_s`).
2. sim: the control plane's own machines on N nodes under a virtual clock (control/testing/sim.py):
   `elect_s` (boot to the first coordinator), `handout_s` (the operator's start to every node
   applying the first allocation), `election_messages` in the first term, each next to the same
   run at 8 nodes (`baseline_8`).
   With gossip, each simulated size also gets bench/gossip_scale.py's `view_ready_s` and
   `gossip_kb_per_s_per_peer` (sampled measurement, against all-pairs at 64 peers in its run).
3. sched: bench/sched.py's figures (its last JSON line), `sched_1024_s` and `sched_10k_s` (CPU
   seconds of one process) lifted to the top level.

Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from common import read_rows, running_swarm, swarm, wait_for

HERE = Path(__file__).resolve().parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---- 1. real daemons ------------------------------------------------------------------------


def _pids(run_dir: Path) -> dict[str, int]:
    from dtfm.swarm.state import load_state
    return {p.name: p.pid for p in load_state(run_dir).peers if p.alive()}


def _memory_mib(pid: int) -> tuple[float, float]:
    """(Pss, private) MiB of a process, from smaps_rollup."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            fields[parts[0][:-1]] = int(parts[1])
    private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return fields.get("Pss", 0) / 1024, private / 1024


def _cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / CLOCK_TICKS  # utime, stime


def _idle(run_dir: Path, idle_s: float) -> dict:
    pids = _pids(run_dir)
    before = {n: _cpu_s(p) for n, p in pids.items()}
    time.sleep(idle_s)
    cpu = sum(_cpu_s(p) - before[n] for n, p in pids.items() if Path(f"/proc/{p}").exists())
    mem = [_memory_mib(p) for p in pids.values()]
    return {"idle_pss_mib": round(statistics.median(m[0] for m in mem), 1),
            "idle_private_mib": round(statistics.median(m[1] for m in mem), 1),
            "idle_cpu_cores": round(cpu / idle_s, 3)}


def _council(run_dir: Path, t: dict[str, dict]) -> tuple[set[str], int]:
    """(names of the council's voters, how many of them may die with a quorum left), as the
    coordinator's status says (quorum: `dtfm.control.election.quorum`, 4 of 5: a council of 5
    survives one voter lost at a time, and replaces it)."""
    from dtfm.swarm.state import load_state
    names = {p.peer_id: p.name for p in load_state(run_dir).peers}
    c = next((v for v in t.values() if v.get("role") == "coordinator"), None) or {}
    voters = {names.get(v, v) for v in c.get("voters") or ()}
    quorum = (c.get("election") or {}).get("quorum", len(voters))
    down = sum(1 for v in voters if v not in t)  # (t: the live peers)
    return voters, max(0, len(voters) - quorum - down)


def _victims(t: dict[str, dict], order: list[str], k: int, voters: set[str], spare_voters: int) -> list[str]:
    """Up to k peers of `order`, first first, that may die together: never the coordinator,
    never the last live holder of a stage (a stage with no holder left is a rollback, which the
    soak measures), no more of the council's voters than it can lose and still elect (a council
    that lost its quorum waits for the operator: `dtfm-peer train council`)."""
    left = Counter(v.get("stage") for v in t.values() if v.get("state") == "training")
    out: list[str] = []
    for name in order:
        if len(out) == k:
            break
        v = t[name]
        holder = v.get("state") == "training"
        if v.get("role") == "coordinator" or (holder and left[v.get("stage")] <= 1):
            continue
        if name in voters:
            if spare_voters <= 0:
                continue
            spare_voters -= 1
        if holder:
            left[v.get("stage")] -= 1
        out.append(name)
    return out


def _training(run_dir: Path) -> dict[str, dict]:
    from dtfm.swarm.proc import peer_status
    from dtfm.swarm.state import load_state
    return {p.name: ((peer_status(p) or {}).get("training") or {}) for p in load_state(run_dir).peers if p.alive()}


def _single_process_step_s(steps: int, batch: int, micro_batches: int) -> float:
    """Median step time of one process training `tiny` whole (a one-peer LocalCluster), same batch."""
    from dtfm.train import LocalCluster, Plan, TrainConfig, get_preset, load_corpus
    spec = get_preset("tiny")
    cfg = TrainConfig(global_batch_seqs=batch, micro_batches=micro_batches)
    with LocalCluster(spec, cfg, Plan.grid(spec.n_layer, 1, 1), load_corpus()) as cl:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            cl.step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] if len(times) > 3 else times)


def _max_loss_deviation(rows: list[dict], batch: int) -> float:
    """The largest relative deviation of a logged step's loss from one process training the
    same steps with the same knobs (train/reference.py)."""
    from dtfm.train import TrainConfig, get_preset, load_corpus
    from dtfm.train.reference import reference_state, reference_step
    state = reference_state(get_preset("tiny"), TrainConfig(global_batch_seqs=batch, micro_batches=1))
    corpus = load_corpus()
    ref: list[float] = []
    worst = 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        while len(ref) <= r["step"]:
            ref.append(reference_step(state, corpus))
        worst = max(worst, abs(r["loss"] - ref[r["step"]]) / abs(ref[r["step"]]))
    return worst


def _say(n: int, t0: float, what: str) -> None:
    print(f"[{n} daemons, {time.monotonic() - t0:6.1f} s] {what}", file=sys.stderr, flush=True)


def _churn(run_dir: Path, n: int, t0: float, churn_s: float, every_s: float, dead: list[str]) -> dict:
    """A peer leaves or comes back every `every_s` seconds for `churn_s` (module docstring);
    `dead`: the peers killed before, which come back first."""
    rng = random.Random(7)
    start, events = time.time(), []
    first_step = max(r["step"] for r in read_rows(run_dir))
    leave = not dead
    end = time.monotonic() + churn_s
    while time.monotonic() < end:
        tick = time.monotonic()
        t = _training(run_dir)
        if leave:
            # every other leave takes a stage holder where its stage keeps another (a spare then
            # fetches the stage: the churn that costs the run something), the others anyone
            order = sorted(t)
            rng.shuffle(order)
            if sum(e[0] == "leave" for e in events) % 2 == 0:
                order.sort(key=lambda name: t[name].get("state") != "training")
            chosen = _victims(t, order, 1, *_council(run_dir, t))
            if chosen:
                name = chosen[0]
                os.kill(_pids(run_dir)[name], signal.SIGKILL)
                dead.append(name)
                events.append(("leave", name, t[name].get("state") == "training"))
        elif dead:
            name = dead.pop(0)
            swarm(run_dir, "restart", name, timeout_s=300)
            events.append(("join", name, False))
        leave = not leave if dead else True
        if events:
            _say(n, t0, f"churn: {events[-1][0]} {events[-1][1]}{' (a stage holder)' if events[-1][2] else ''}")
        time.sleep(max(0.0, every_s - (time.monotonic() - tick)))
    swarm(run_dir, "wait", "--step", str(max(r["step"] for r in read_rows(run_dir)) + 2), "--timeout", "900")
    rows = read_rows(run_dir)
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    rollbacks = [e for e in evs if e.get("event") == "rollback" and e.get("time", 0) > start]
    return {"churn_s": churn_s, "leaves": sum(e[0] == "leave" for e in events),
            "holders_left": sum(e[2] for e in events), "joins": sum(e[0] == "join" for e in events),
            "steps_during": max(r["step"] for r in rows if r["time"] <= start + churn_s) - first_step,
            "rollbacks": len(rollbacks), "steps_lost": sum(int(e.get("steps_lost") or 0) for e in rollbacks)}


def bench_daemons(n: int, steps: int, idle_s: float, shape: tuple[int, int] | None = None, *,
                  churn_s: float = 0.0, churn_every_s: float = 10.0) -> dict:
    t0 = time.monotonic()
    _say(n, t0, "dtfm-swarm up")
    with running_swarm("--scenario", "worldwide", "--peers", str(n), "--timeout", "900", up_timeout_s=1200,
                       kill=True) as run_dir:
        out: dict = {"peers": n, "up_s": round(time.monotonic() - t0, 1)}
        _say(n, t0, f"up; idle for {idle_s:g} s")
        out.update(_idle(run_dir, idle_s))
        batch = max(8, n)
        t1 = time.monotonic()
        asked = () if shape is None else ("--stages", str(shape[0]), "--dp", str(shape[1]))
        _say(n, t0, f"train start (batch {batch}{'' if shape is None else f', {shape[0]} x {shape[1]}'})")
        reply = json.loads(swarm(run_dir, "train", "--steps", "100000", "--batch", str(batch), "--micro-batches",
                                 "1", *asked, "--start-timeout", "840", "--json", timeout_s=900, stdout=True))
        out["handout_s"] = round(time.monotonic() - t1, 1)
        out["shape"] = f"{reply.get('stages')}x{reply.get('dp')}"
        out["shape_note"] = reply.get("shape_note", "")
        _say(n, t0, f"training {out['shape']}; waiting for step {steps}")
        swarm(run_dir, "wait", "--step", str(steps), "--timeout", "900")
        rows = read_rows(run_dir)
        out["step_s"] = round(statistics.median(r["iteration_s"] for r in rows[2:]), 3)
        t = _training(run_dir)
        # An eighth of the peers, none the coordinator: stage holders first (a spare's loss
        # changes nothing the run waits for), but never the last holder of a stage (a stage
        # with no holder left is a rollback, which the soak measures), then spares.
        order = sorted(t, key=lambda name: (t[name].get("state") != "training", name))
        victims = _victims(t, order, max(1, n // 8), *_council(run_dir, t))
        holders = [v for v in victims if t[v].get("state") == "training"]
        pids = _pids(run_dir)
        last = max(r["step"] for r in rows)
        epoch = max(r["epoch"] for r in rows)
        killed = time.time()
        _say(n, t0, f"SIGKILL {len(victims)} peers ({len(holders)} holding a stage)")
        for v in victims:
            os.kill(pids[v], signal.SIGKILL)

        def next_step():  # (`wait` merges the peers' logs into the run dir's)
            swarm(run_dir, "wait", "--step", str(max(r["step"] for r in read_rows(run_dir)) + 2), "--timeout", "900")
            return [r for r in read_rows(run_dir) if r["time"] > killed and (r["epoch"] > epoch or not holders)]
        out["killed"], out["killed_holders"] = len(victims), len(holders)
        try:
            after = wait_for("a step after the kills", next_step, 900, interval_s=0.0)
        except RuntimeError as e:
            out["recover_s"], out["error"] = None, str(e)
            return out
        first = min(after, key=lambda r: r["step"])
        out["recover_s"] = round(first["time"] - killed, 1)
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
        out["rolled_back"] = any(e.get("event") == "rollback" and e.get("time", 0) > killed for e in events)
        out["steps_lost"] = max(0, last + 1 - first["step"]) if out["rolled_back"] else 0
        _say(n, t0, f"training again after {out['recover_s']} s")
        if churn_s > 0:
            _say(n, t0, f"churn for {churn_s:g} s: a peer leaves or comes back every {churn_every_s:g} s")
            out["churn"] = _churn(run_dir, n, t0, churn_s, churn_every_s, victims)
        _say(n, t0, "checking every step against one process")
        rows = read_rows(run_dir)
        out["steps_logged"] = len(rows)
        out["every_step_once"] = [r["step"] for r in rows] == list(range(len(rows)))
        out["max_loss_rel_dev"] = float(f"{_max_loss_deviation(rows, batch):.3g}")
    out["single_process_step_s"] = round(_single_process_step_s(min(steps, 6), batch, 1), 3)
    return out


# ---- 2. the control plane in simulation -------------------------------------------------------


def sim_figures(n: int, seed: int = 1) -> dict:
    from dtfm.control.election import ElectionConfig
    from dtfm.control.testing.sim import PlaneSim
    sim = PlaneSim(n, ElectionConfig.test(), seed=seed)
    while not sim.wins and sim.now < 30:
        sim.run_for(0.01)
    elect_s = sim.wins[0][0]
    sim.run_for(2.0)
    messages = sim.sent
    [c] = sim.coordinators()
    t0 = sim.now
    sim.start_training(c, steps=20)
    while any(a == (0, 0) for a in sim.disk_applied) and sim.now < t0 + 30:
        sim.run_for(0.01)
    return {"peers": n, "elect_s": round(elect_s, 3), "handout_s": round(sim.now - t0, 3),
            "election_messages": messages}


# ---- 3. other benches --------------------------------------------------------------------------


def last_json(script: str, *args: str, timeout_s: float = 3600) -> dict | None:
    path = HERE / script
    if not path.exists():
        return None
    out = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        print(f"{script} failed: {out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--daemons", default="16,32,64", help="swarm sizes of real daemons (comma list)")
    ap.add_argument("--sim", default="256,1000", help="swarm sizes in simulation (comma list)")
    ap.add_argument("--only", default="daemons,sim,gossip,sched", help="sections to run (comma list)")
    ap.add_argument("--steps", type=int, default=8, help="steps before the kills")
    ap.add_argument("--idle-s", type=float, default=20.0, help="seconds the idle swarm is watched")
    ap.add_argument("--stages", type=int, default=None, help="the run's stages (with --dp; default: the scheduler's shape)")
    ap.add_argument("--dp", type=int, default=None, help="the run's pipelines (with --stages)")
    ap.add_argument("--churn-s", type=float, default=0.0,
                    help="daemons: seconds of churn after the kills (a peer leaves or comes back in turn)")
    ap.add_argument("--churn-every", type=float, default=10.0, help="daemons: seconds between churn events")
    args = ap.parse_args(argv)
    if (args.stages is None) != (args.dp is None):
        ap.error("--stages and --dp go together")
    only = set(args.only.split(","))
    result: dict = {}
    if "sim" in only:
        base = sim_figures(8)
        result["sim"] = [{**sim_figures(int(n)), "baseline_8": base} for n in args.sim.split(",")]
        print(f"sim: {result['sim']}", file=sys.stderr)
    if "gossip" in only:  # the gossip figures of each simulated size, beside the plane's
        gossip = last_json("gossip_scale.py", "--sizes", args.sim)
        if gossip is not None:
            result["gossip"] = gossip
            for row in result.get("sim", []):
                g = gossip["sizes"].get(str(row["peers"]), {})
                row.update({k: g[k] for k in ("view_ready_s", "gossip_kb_per_s_per_peer") if k in g})
    if "daemons" in only:
        result["daemons"] = []
        for n in args.daemons.split(","):
            fig = bench_daemons(int(n), args.steps, args.idle_s,
                                None if args.stages is None else (args.stages, args.dp),
                                churn_s=args.churn_s, churn_every_s=args.churn_every)
            print(f"daemons: {fig}", file=sys.stderr)
            result["daemons"].append(fig)
    if "sched" in only:
        sched = last_json("sched.py")
        if sched is not None:
            result["sched"] = sched
            result["sched_1024_s"] = sched.get("sched_1024_s")
            result["sched_10k_s"] = sched.get("sched_10k_s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
