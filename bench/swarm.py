"""The daemons training together, against baselines measured in the same run.

    .venv/bin/python bench/swarm.py [--only loopback,comm,transport,worldwide,recovery,gray] [--steps 12] [--world-steps 8]

1. loopback: `tiny` as 2 stages x 2 pipelines in four `dtfm-peer` daemons on plain loopback
   (`dtfm-swarm up --no-emulation`) vs `LocalCluster` 2 x 2 in this process: tokens/s ratio
   (target >= 0.8). Median over the steps after the first two.
2. comm: 64 MiB tensors through `TransportComm` from one process to another (stage 0 -> 1
   activations of a model whose boundary tensor is 64 MiB) vs `bench/transport.py`'s encrypted
   transport figure (64 MiB payloads, same total): throughput ratio (target >= 0.8). Each of
   `--comm-rounds` rounds isends its tensors at once, as a step does; the best round counts
   (the transport's figure is its best of 3), and each side's CPU per GiB is set beside the
   transport's (the ratio the cores' other work distorts least).
3. transport: CPU-seconds per GiB of the encrypted transport on each side vs raw TCP on that side
   plus libsodium's AEAD alone (target <= 1.5).
4. worldwide: 8 daemons on the emulated worldwide scenario; the scheduler's allocation, then a
   random allocation of the same shape: measured median iteration time vs the simulator's
   prediction for each, and the measured speedup next to the predicted one.
5. recovery: 8 daemons on the emulated worldwide scenario train 2 x 4; a follower with a stage
   (a council voter) is SIGKILLed, later (once the council took the dead follower out: a council of
   five needs four votes) the coordinator: the time from the kill to the next completed step, split
   into detection (kill to the coordinator's reconfiguration; for the killed coordinator:
   detection and election, kill to the new coordinator's election, then the take-over to its
   reconfiguration), stop (run states, aborting the failed step), scheduling, offers
   (holders encode their stages), weight transfer (the slowest peer's fetch), the rest of the
   hand-out, and the first step; bytes moved per reconfiguration. The baseline is the median
   iteration time of the same run before the kill.
6. gray: the same swarm; a follower with a stage is frozen (SIGSTOP), later woken, then the link
   between two pipeline neighbours is cut, later healed: the time from each fault to the next
   completed step, split as in 5 (detection: the step deadline and the probe of the laggards),
   and its cause as the reconfiguration's event names it.

Wall-clock figures share this machine's cores with everything else running on it; CPU-s per
GiB do not. Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import trio

from dtfm.control import CommConfig, TensorRouter, TransportComm
from dtfm.net import Identity, Transport, TransportConfig
from dtfm.train import GPTSpec, LocalCluster, MessageRules, Plan, TrainConfig, get_preset, load_corpus

from common import WAN_PLANE, read_rows, running_swarm, swarm, wait_for

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
WORLDWIDE_8 = ("--scenario", "worldwide", "--peers", "8", "--timeout", "300", *WAN_PLANE)

def transport_figures(total_mib: int) -> dict:
    """bench/transport.py's JSON line, run as its own process with 64 MiB payloads."""
    cmd = [sys.executable, str(HERE / "transport.py"), "--total-mib", str(total_mib), "--payload-mib", "64"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"bench/transport.py failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_run(run_dir: Path, steps: int, *train_args: str) -> tuple[dict, list[dict]]:
    """`dtfm-swarm train` on a running swarm, wait for the last step; the issuer's reply and the log."""
    reply = json.loads(swarm(run_dir, "train", "--json", "--steps", str(steps), *train_args, stdout=True))
    swarm(run_dir, "wait", "--step", str(steps), "--timeout", "900")
    return reply, read_rows(run_dir)


def median_after(rows: list[dict], key: str, skip: int) -> float:
    return statistics.median(r[key] for r in rows[skip:])


# ---- 1. four daemons on loopback vs LocalCluster ------------------------------------------------


def bench_loopback(steps: int) -> dict:
    with running_swarm("--scenario", "datacenter", "--peers", "4", "--no-emulation", "--timeout", "120") as run_dir:
        _, rows = train_run(run_dir, steps, "--stages", "2", "--dp", "2")
    daemons = median_after(rows, "tokens_per_s", 2)
    spec, cfg = get_preset("tiny"), TrainConfig()
    with LocalCluster(spec, cfg, Plan.grid(spec.n_layer, 2, 2), load_corpus()) as cl:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            cl.step()
            times.append(time.perf_counter() - t0)
    local = cfg.global_batch_seqs * spec.seq_len / statistics.median(times[2:])
    return {"loopback_daemons_tokens_per_s": round(daemons), "loopback_local_cluster_tokens_per_s": round(local),
            "ratio_daemons_over_local_cluster": round(daemons / local, 3),
            "loopback_losses_equal": [None if r.get("loss") is None else round(r["loss"], 6) for r in rows[:3]]}


# ---- 2. 64 MiB tensors through the Comm between two processes -----------------------------------

SPEC64 = GPTSpec("bench64", n_layer=2, n_embd=1024, n_head=16, seq_len=1024)
CFG64 = TrainConfig(global_batch_seqs=16, micro_batches=1)  # one (16, 1024, 1024) float32 = 64 MiB
EPOCH, RUN = 1, b"bench-swarm-comm"


def _plan64(sender: bytes, receiver: bytes) -> Plan:
    return Plan(((sender, receiver),), ((0, 1), (1, 2)), EPOCH)


def _comm_receiver(key: bytes, q_out, q_in, messages: int, rounds: int) -> None:
    async def main():
        t = Transport(Identity.generate(), key, TransportConfig.default())
        router = TensorRouter(t)
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(t.serve, "127.0.0.1", 0)
            q_out.put((t.peer_id, port))
            sender = await trio.to_thread.run_sync(q_in.get)
            plan = _plan64(sender, t.peer_id)
            comm = TransportComm(t, MessageRules.for_peer(plan, SPEC64, CFG64, t.peer_id, []), run=RUN,
                                 router=router, config=CommConfig.default())
            await nursery.start(comm.run)

            def consume():
                for _ in range(rounds):
                    for k in range(messages):
                        x = comm.recv(sender, f"{EPOCH}.{k}/act/0", 120.0)
                        if k == 0:
                            t0, cpu0 = time.perf_counter(), time.process_time()
                        del x
                    q_out.put((time.perf_counter() - t0, time.process_time() - cpu0))

            await trio.to_thread.run_sync(consume)
            await trio.to_thread.run_sync(q_in.get)  # the sender is done with us
            comm.close()
            await t.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


def bench_comm(messages: int, rounds: int) -> dict:
    """`rounds` rounds of `messages` + 1 tensors of 64 MiB, each round isent at once and waited
    for, as training sends a step's tensors; the best round's throughput (bench/transport.py's
    figure is its best of 3 too), the first round's, and each side's CPU per GiB (the lowest)."""
    key = os.urandom(32)
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_comm_receiver, args=(key, q_out, q_in, messages + 1, rounds))
    p.start()
    try:
        receiver, port = q_out.get(timeout=60)

        async def main():
            t = Transport(Identity.generate(), key, TransportConfig.default())
            router = TensorRouter(t)
            async with trio.open_nursery() as nursery:
                await nursery.start(t.serve, "127.0.0.1", 0)
                q_in.put(t.peer_id)
                plan = _plan64(t.peer_id, receiver)
                comm = TransportComm(t, MessageRules.for_peer(plan, SPEC64, CFG64, t.peer_id, []), run=RUN,
                                     router=router, config=CommConfig.default())
                await nursery.start(comm.run)
                await comm.connect({receiver: ("127.0.0.1", port)}, 30.0)
                x = torch.randn(16, 1024, 1024)

                def send_all():
                    cpu0 = time.process_time()
                    handles = [comm.isend(receiver, f"{EPOCH}.{k}/act/0", x) for k in range(messages + 1)]
                    for h in handles:
                        h.wait(120.0)
                    return time.process_time() - cpu0

                out = []
                for _ in range(rounds):
                    cpu = await trio.to_thread.run_sync(send_all)
                    out.append((*(await trio.to_thread.run_sync(q_out.get, True, 120.0)), cpu))
                q_in.put("done")
                comm.close()
                await t.aclose()
                nursery.cancel_scope.cancel()
                return out

        out = trio.run(main)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    # the first tensor of a round starts the receiver's clock: `messages` more arrived in `elapsed`
    rate = [messages * 64 * MiB / elapsed / 1e9 for elapsed, _, _ in out]
    gib = 64 * MiB / (1 << 30)
    return {"comm_64MiB_GBps": round(max(rate), 3), "comm_64MiB_GBps_first_round": round(rate[0], 3),
            "comm_messages": messages, "comm_rounds": rounds,
            "comm_sender_cpu_s_per_GiB": round(min(c for _, _, c in out) / ((messages + 1) * gib), 3),
            "comm_receiver_cpu_s_per_GiB": round(min(c for _, c, _ in out) / (messages * gib), 3)}


# ---- 4. emulated worldwide: scheduler vs random allocation, measured vs predicted -------------


def bench_worldwide(steps: int) -> dict:
    with running_swarm(*WORLDWIDE_8) as run_dir:
        sched_reply, sched_rows = train_run(run_dir, steps)
        shape = ("--stages", str(sched_reply["stages"]), "--dp", str(sched_reply["dp"]))
        rand_reply, rand_rows = train_run(run_dir, steps, *shape, "--placement", "random", "--seed", "1")
    out = {"world_shape": f"{sched_reply['stages']}x{sched_reply['dp']}"}
    for name, reply, rows in (("scheduler", sched_reply, sched_rows), ("random", rand_reply, rand_rows)):
        measured = median_after(rows, "iteration_s", 1)
        out[f"world_{name}_predicted_s"] = round(reply["predicted_iteration_s"], 3)
        out[f"world_{name}_measured_s"] = round(measured, 3)
        out[f"world_{name}_measured_over_predicted"] = round(measured / reply["predicted_iteration_s"], 3)
        for phase in ("compute_s", "pipeline_s", "sync_s"):  # the slowest peer's, per step
            out[f"world_{name}_{phase}"] = round(median_after(rows, phase, 1), 3)
    out["world_speedup_measured"] = round(out["world_random_measured_s"] / out["world_scheduler_measured_s"], 3)
    out["world_speedup_predicted"] = round(out["world_random_predicted_s"] / out["world_scheduler_predicted_s"], 3)
    return out


# ---- 5. recovery after a SIGKILL ----------------------------------------------------------------


def _training(run_dir: Path) -> dict[str, dict]:
    from dtfm.swarm.proc import peer_status
    from dtfm.swarm.state import load_state
    return {p.name: ((peer_status(p) or {}).get("training") or {}) for p in load_state(run_dir).peers if p.alive()}


def _recover_once(run_dir: Path, victim: str, label: str, fault=None) -> dict:
    """The time from a fault (SIGKILL of `victim`, or `fault()`) to the next completed step of a
    newer epoch, and its phases."""
    rows = read_rows(run_dir)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    epoch = max([r["epoch"] for r in rows] + [e["epoch"] for e in events if isinstance(e.get("epoch"), int)])
    killed = time.time()
    if fault is None:
        swarm(run_dir, "kill", victim)
    else:
        fault()
    deadline = time.monotonic() + 600
    while True:  # the first step of a newer epoch
        swarm(run_dir, "wait", "--step", str(rows[-1]["step"] + 2), "--timeout", "600")
        rows = read_rows(run_dir)
        after = [r for r in rows if r["epoch"] > epoch and r["time"] > killed and not r.get("backfilled")]
        if after or time.monotonic() > deadline:
            break
    first = min(after, key=lambda r: r["step"])
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    rec = [e for e in events if e.get("event") in ("reconfigure", "rollback") and e.get("started_at", 0) >= killed]
    rec = min(rec, key=lambda e: e["started_at"])
    elected = [e["time"] for e in events if e.get("event") == "coordinator" and killed <= e["time"] <= rec["started_at"]]
    first_step_s = first["time"] - (rec["started_at"] + rec["stop_s"] + rec["schedule_s"] + rec["offer_s"]
                                    + rec["handout_s"])
    if elected:  # the coordinator was killed: its followers notice only by the election timeout
        phases = {"detection_and_election_s": min(elected) - killed, "takeover_s": rec["started_at"] - min(elected)}
    else:
        phases = {"detection_s": rec["started_at"] - killed}
    out = {"recovery_s": first["time"] - killed, **phases, "cause": rec.get("trigger", ""),
           "stop_s": rec["stop_s"], "scheduling_s": rec["schedule_s"], "offers_s": rec["offer_s"],
           "weight_transfer_s": rec["transfer_s"], "handout_s": rec["handout_s"] - rec["transfer_s"],
           "first_step_s": first_step_s, "bytes_moved": rec["bytes_moved"],
           "shape": f"{rec['old_shape']}->{rec['new_shape']} ({rec.get('kind')})"}
    return {f"{label}_{k}": round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def _council_without(run_dir: Path, name: str) -> bool:
    """The coordinator's council does not hold peer `name` (or it never did)."""
    from dtfm.swarm.state import load_state
    gone = next(p.peer_id for p in load_state(run_dir).peers if p.name == name)
    voters = [v.get("voters") for v in _training(run_dir).values() if v.get("role") == "coordinator"]
    return bool(voters) and isinstance(voters[0], list) and bool(gone) and gone not in voters[0]


def _endless_run(run_dir: Path, wait_step: int) -> tuple[float, str]:
    """Start a 2x4 run that lasts until the swarm is taken down and wait for step `wait_step`:
    the median step time so far and a follower that holds a stage (a council voter where one
    does)."""
    swarm(run_dir, "train", "--stages", "2", "--dp", "4", "--steps", "100000")
    swarm(run_dir, "wait", "--step", str(wait_step + 1), "--timeout", "600")
    base = median_after(read_rows(run_dir), "iteration_s", 1)
    t = _training(run_dir)
    from dtfm.swarm.state import load_state
    ids = {p.name: p.peer_id for p in load_state(run_dir).peers}
    voters = next((set(v.get("voters") or ()) for v in t.values() if v.get("role") == "coordinator"), set())
    # (a voter where one holds a stage: its loss is the one the council must make up for)
    return base, min((n for n, v in t.items() if v.get("stage") is not None and v.get("role") != "coordinator"),
                     key=lambda n: (ids.get(n) not in voters, n))


def bench_recovery() -> dict:
    with running_swarm(*WORLDWIDE_8) as run_dir:
        base, follower = _endless_run(run_dir, 4)
        out = {"recovery_baseline_iteration_s": round(base, 3)}
        killed = time.time()
        out.update(_recover_once(run_dir, follower, "follower_kill"))
        swarm(run_dir, "wait", "--step", str(read_rows(run_dir)[-1]["step"] + 3), "--timeout", "600")
        # A council of five needs four votes: the coordinator is killed once the council took the
        # dead follower out (a reconfiguration once gossip has counted it dead for a while), as a
        # second voter lost before that leaves the swarm electing nobody.
        wait_for("the council without the killed follower", lambda: _council_without(run_dir, follower), 300)
        out["follower_kill_council_whole_s"] = round(time.time() - killed, 3)
        coordinator = next(n for n, v in _training(run_dir).items() if v.get("role") == "coordinator")
        out.update(_recover_once(run_dir, coordinator, "coordinator_kill"))
    out["follower_kill_recovery_in_iterations"] = round(out["follower_kill_recovery_s"] / base, 2)
    out["coordinator_kill_recovery_in_iterations"] = round(out["coordinator_kill_recovery_s"] / base, 2)
    return out


# ---- 6. gray failures: a frozen peer, a cut link ----------------------------------------------


def bench_gray() -> dict:
    """A follower with a stage is frozen (SIGSTOP: its sockets stay open, it answers nothing),
    later woken; then the link between two pipeline neighbours is cut, later healed. For each:
    seconds from the fault to the next completed step, split as for a SIGKILL (detection is the
    step deadline plus the probe)."""
    from dtfm.swarm.state import load_state
    with running_swarm(*WORLDWIDE_8) as run_dir:
        base, follower = _endless_run(run_dir, 6)
        pid = next(p.pid for p in load_state(run_dir).peers if p.name == follower)
        out = {"gray_baseline_iteration_s": round(base, 3)}
        try:
            out.update(_recover_once(run_dir, follower, "frozen_peer", lambda: os.kill(pid, signal.SIGSTOP)))
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(f"the woken {follower} placed again",
                 lambda: (_training(run_dir).get(follower) or {}).get("state") == "training", 300)
        out["frozen_peer_woken_placed_again"] = True
        swarm(run_dir, "wait", "--step", str(read_rows(run_dir)[-1]["step"] + 3), "--timeout", "600")
        t = _training(run_dir)  # two pipeline neighbours, neither the coordinator (a link cut between
        # the coordinator and a peer puts the peer out of its reach: it leaves like a frozen one)
        a, b = next((n, m) for n, v in t.items() for m, w in t.items()
                    if v.get("stage") == 0 and w.get("stage") == 1 and v.get("pipeline") == w.get("pipeline")
                    and "coordinator" not in (v.get("role"), w.get("role")))
        try:
            out.update(_recover_once(run_dir, a, "cut_link", lambda: swarm(run_dir, "partition", a, b)))
        finally:
            swarm(run_dir, "heal")
    out["frozen_peer_recovery_in_iterations"] = round(out["frozen_peer_recovery_s"] / base, 2)
    out["cut_link_recovery_in_iterations"] = round(out["cut_link_recovery_s"] / base, 2)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="loopback,comm,transport,worldwide,recovery,gray",
                    help="comma-separated parts to run (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="training steps on loopback (default: %(default)s)")
    ap.add_argument("--world-steps", type=int, default=8,
                    help="training steps per allocation on the worldwide swarm (default: %(default)s)")
    ap.add_argument("--comm-messages", type=int, default=8, help="64 MiB tensors timed per round (default: %(default)s)")
    ap.add_argument("--comm-rounds", type=int, default=3, help="rounds of them; the best counts (default: %(default)s)")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    torch.set_num_threads(1)
    result: dict = {}

    def show(d: dict) -> None:
        for k, v in d.items():
            print(f"{k:48s} {v}", flush=True)
        result.update(d)

    if "loopback" in parts:
        show(bench_loopback(args.steps))
    if "comm" in parts or "transport" in parts:
        tr = transport_figures(max(256, args.comm_messages * 64))
        if "comm" in parts:
            comm = bench_comm(args.comm_messages, args.comm_rounds)
            comm["transport_encrypted_GBps"] = tr["b_transport_encrypted_GBps"]
            comm["ratio_comm_over_transport"] = round(comm["comm_64MiB_GBps"] / tr["b_transport_encrypted_GBps"], 3)
            for side in ("sender", "receiver"):
                comm[f"ratio_comm_{side}_cpu_over_transport"] = round(
                    comm[f"comm_{side}_cpu_s_per_GiB"] / tr[f"b_{side}_cpu_s_per_GiB"], 3)
            show(comm)
        if "transport" in parts:  # bench/transport.py's own figures and ratios, renamed
            show({f"transport_{side}_cpu_s_per_GiB": tr[f"b_{side}_cpu_s_per_GiB"] for side in ("sender", "receiver")}
                 | {f"raw_tcp_{side}_cpu_s_per_GiB": tr[f"a_{side}_cpu_s_per_GiB"] for side in ("sender", "receiver")}
                 | {"sodium_cpu_s_per_GiB": tr["d_sodium_cpu_s_per_GiB"]}
                 | {f"ratio_{side}_over_raw_plus_crypto": tr[f"ratio_b_{side}_cpu_over_a_plus_d"]
                    for side in ("sender", "receiver")})
    if "worldwide" in parts:
        show(bench_worldwide(args.world_steps))
    if "recovery" in parts:
        show(bench_recovery())
    if "gray" in parts:
        show(bench_gray())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
