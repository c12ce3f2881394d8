"""What an idle daemon costs: memory and CPU of a scripted swarm before any run, and how fast the
operator's commands answer it.

Starts N daemons with `dtfm-swarm up` (datacenter scenario, no emulation), waits until the swarm
has converged and then `--settle` seconds more, and measures each daemon: private memory
(Private_Clean + Private_Dirty of /proc/PID/smaps_rollup), Pss, and the CPU it used over
`--window` seconds (cores). Then the wall time of `dtfm-peer status` and `dtfm-peer train stop`
(the operator's brake; with no run it is refused after the daemon's answer) run as the operator
would, and of the daemon's own status answer over its control socket.

The baseline is the same swarm in the same run with DTFM_PRELOAD=torch,scipy: every daemon imports
torch and scipy at start, as each did before they were loaded on first use (torch with the first
stage, scipy with the first schedule).

    .venv/bin/python bench/idle.py                  # 8 daemons, then the baseline's 8
    .venv/bin/python bench/idle.py --peers 16 --settle 10
    .venv/bin/python bench/idle.py --peers 32 --no-baseline   # this tree's daemons only
    .venv/bin/python bench/idle.py --during-run               # the commands while a run trains

`--during-run`: 4 daemons (no emulation) idle, then training `tiny` as 2 stages x 2 pipelines;
the same commands against a daemon holding a stage, idle (the baseline) and between steps, the
brake last (`train stop`, which then stops the run: it is timed once, and the run is checked
stopped). The goal (issue "From eight peers to hundreds"): each under a second during the run.

Prints a table per swarm on stderr and, last, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import print_table, running_swarm

CLI_TRIES = 5
PAGE_TICKS = os.sysconf("SC_CLK_TCK")


def rollup(pid: int) -> dict[str, float]:
    """smaps_rollup's figures of `pid`, in MiB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / PAGE_TICKS


def maps_torch(pid: int) -> bool:
    return "/torch/" in Path(f"/proc/{pid}/maps").read_text()


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, timeout=120, env=env)
    return time.perf_counter() - t0


def socket_status_s(data_dir: str) -> float:
    from dtfm.peer.config import SocketConfig
    from dtfm.peer.control_client import ControlClient

    t0 = time.perf_counter()
    with ControlClient(Path(data_dir) / "control" / "peer.sock", SocketConfig(request_timeout_s=30.0)) as c:
        c.request("status")
    return time.perf_counter() - t0


def stage_holder(run_dir: Path) -> str:
    """The data dir of a daemon holding a stage of the run."""
    from dtfm.peer.config import SocketConfig
    from dtfm.peer.control_client import ControlClient

    state = json.loads((run_dir / "swarm.json").read_text())
    for p in state["peers"]:
        with ControlClient(Path(p["data_dir"]) / "control" / "peer.sock", SocketConfig(request_timeout_s=30.0)) as c:
            if (c.request("status").get("training") or {}).get("stage") is not None:
                return p["data_dir"]
    raise RuntimeError("no daemon holds a stage")


def measure_run(steps_before: int) -> dict:
    """The operator's commands against a daemon idle, then while it trains (module docstring)."""
    from common import swarm

    env = dict(os.environ)
    cli = [sys.executable, "-m", "dtfm.peer"]
    with running_swarm("--peers", "4", "--scenario", "datacenter", "--no-emulation",
                       prefix="dtfm-idle-") as run_dir:
        state = json.loads((run_dir / "swarm.json").read_text())
        first = state["peers"][0]["data_dir"]
        idle = {"status": [timed([*cli, "status", "--data-dir", first], env) for _ in range(CLI_TRIES)],
                "socket": [socket_status_s(first) for _ in range(CLI_TRIES)]}
        swarm(run_dir, "train", "--stages", "2", "--dp", "2", "--steps", "100000")
        swarm(run_dir, "wait", "--step", str(steps_before), "--timeout", "900")
        holder = stage_holder(run_dir)
        during = {"status": [timed([*cli, "status", "--data-dir", holder], env) for _ in range(CLI_TRIES)],
                  "socket": [socket_status_s(holder) for _ in range(CLI_TRIES)]}
        t0 = time.perf_counter()
        done = subprocess.run([*cli, "train", "stop", "--data-dir", holder], capture_output=True, text=True,
                              timeout=120, env=env)
        stop_s = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"train stop failed: {done.stderr.strip()}")
        rows = [json.loads(x) for x in (run_dir / "train.jsonl").read_text().splitlines() if x.strip()]
    med = statistics.median
    table = [("dtfm-peer status", f"{med(idle['status']):.3f}", f"{med(during['status']):.3f}"),
             ("the daemon's status answer", f"{med(idle['socket']):.4f}", f"{med(during['socket']):.4f}"),
             ("dtfm-peer train stop (once)", "-", f"{stop_s:.3f}")]
    print(f"\n4 daemons, tiny 2 x 2 training (median of {CLI_TRIES}, seconds):", file=sys.stderr)
    print_table(("command", "idle", "during the run"), table)
    return {"idle_cli_status_s": round(med(idle["status"]), 3), "run_cli_status_s": round(med(during["status"]), 3),
            "run_cli_status_max_s": round(max(during["status"]), 3),
            "idle_socket_status_s": round(med(idle["socket"]), 4), "run_socket_status_s": round(med(during["socket"]), 4),
            "run_cli_train_stop_s": round(stop_s, 3), "steps_logged": len(rows),
            "under_a_second": max(during["status"]) < 1.0 and stop_s < 1.0}


def measure(peers: int, settle_s: float, window_s: float, preload: str) -> dict:
    env = {**os.environ, "DTFM_PRELOAD": preload}
    os.environ["DTFM_PRELOAD"] = preload  # (dtfm-swarm up passes its environment to the daemons)
    try:
        with running_swarm("--peers", str(peers), "--scenario", "datacenter", "--no-emulation",
                           prefix="dtfm-idle-") as run_dir:
            state = json.loads((run_dir / "swarm.json").read_text())
            pids = [p["pid"] for p in state["peers"]]
            dirs = [p["data_dir"] for p in state["peers"]]
            time.sleep(settle_s)
            before = {pid: cpu_s(pid) for pid in pids}
            t0 = time.monotonic()
            time.sleep(window_s)
            elapsed = time.monotonic() - t0
            cores = [(cpu_s(pid) - before[pid]) / elapsed for pid in pids]
            mem = [rollup(pid) for pid in pids]
            torch_mapped = sum(maps_torch(pid) for pid in pids)
            cli = [sys.executable, "-m", "dtfm.peer"]
            status = [timed([*cli, "status", "--data-dir", dirs[i % peers]], env) for i in range(CLI_TRIES)]
            stop = [timed([*cli, "train", "stop", "--data-dir", dirs[i % peers]], env) for i in range(CLI_TRIES)]
            answer = [socket_status_s(dirs[i % peers]) for i in range(CLI_TRIES)]
    finally:
        os.environ.pop("DTFM_PRELOAD", None)
    private = [m["Private_Clean"] + m["Private_Dirty"] for m in mem]
    pss = [m["Pss"] for m in mem]
    rows = [(i, f"{private[i]:.1f}", f"{pss[i]:.1f}", f"{mem[i]['Rss']:.1f}", f"{cores[i]:.3f}") for i in range(peers)]
    print(f"\n{peers} idle daemons, DTFM_PRELOAD={preload or '(none)'}:", file=sys.stderr)
    print_table(("daemon", "private MiB", "Pss MiB", "Rss MiB", "CPU cores"), rows)
    return {
        "preload": preload, "daemons": peers, "torch_mapped": torch_mapped,
        "private_mib": [round(x, 1) for x in private], "pss_mib": [round(x, 1) for x in pss],
        "idle_cpu_cores": [round(x, 4) for x in cores],
        "median_private_mib": round(statistics.median(private), 1), "max_private_mib": round(max(private), 1),
        "median_pss_mib": round(statistics.median(pss), 1), "total_pss_mib": round(sum(pss), 1),
        "total_idle_cpu_cores": round(sum(cores), 3),
        "cli_status_s": round(statistics.median(status), 3), "cli_train_stop_s": round(statistics.median(stop), 3),
        "socket_status_s": round(statistics.median(answer), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=8, help="daemons in each swarm (default 8)")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds idle after `up` before measuring")
    parser.add_argument("--window", type=float, default=10.0, help="seconds over which idle CPU is measured")
    parser.add_argument("--no-baseline", action="store_true", help="measure this tree's daemons only")
    parser.add_argument("--during-run", action="store_true",
                        help="time the operator's commands while 4 daemons train (module docstring)")
    parser.add_argument("--steps", type=int, default=3, help="--during-run: steps trained before the commands")
    args = parser.parse_args()
    if args.during_run:
        print(json.dumps(measure_run(args.steps)))
        return 0
    light = measure(args.peers, args.settle, args.window, "")
    if args.no_baseline:
        print(json.dumps({"daemons": args.peers, "light": light, "within_60_mib": light["max_private_mib"] <= 60.0}))
        return 0
    eager = measure(args.peers, args.settle, args.window, "torch,scipy")
    out = {"daemons": args.peers, "light": light, "baseline_eager": eager,
           "private_saved_mib": round(eager["median_private_mib"] - light["median_private_mib"], 1),
           "private_ratio": round(light["median_private_mib"] / eager["median_private_mib"], 3),
           "within_60_mib": light["max_private_mib"] <= 60.0}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
