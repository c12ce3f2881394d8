"""A peer's memory while it trains, against its stage's own state and one process training the
whole model (the baseline, measured in the same run).

    .venv/bin/python bench/memory.py [--preset small] [--steps 3] [--batch 8] [--micro-batches 2]
                                     [--log-dir DIR]

1. baseline: `python -m dtfm.train` of the same preset, batch and micro-batches in one process
   (1 x 1), `--steps` steps: its peak resident memory (the kernel's ru_maxrss of the child).
2. the swarm: four `dtfm-peer` daemons on plain loopback (`dtfm-swarm up --no-emulation`)
   train 2 stages x 2 pipelines, each stage checkpointed every other step. A sampler reads every
   daemon's resident memory (/proc/PID/status VmRSS, VmHWM) every 0.2 s. After `--steps` steps
   a follower that holds a stage is SIGKILLed; the others train on without it (a new epoch,
   the stage fetched where the scheduler moves it), then it is restarted with its data dir and
   the swarm takes it back (it fetches a stage: a weight transfer), and trains `--steps` more.
3. for each daemon: its peak resident memory in each phase (training, after the kill, after the
   restart) against its stage's own state as the daemon reports it in `dtfm-peer status`
   (`training.memory`: weights, gradients, optimizer, the one-step-back snapshot, the last
   step's activations), and the ratio of the whole run's peak to that state (the goal: at most
   1.5).

The stage state is the largest one the daemon held during the run. Prints one JSON object as its
last line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import print_table, running_swarm, swarm, wait_for

MiB = 1 << 20


def proc_memory(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of a live process in bytes; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    got = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            got[key] = int(value.split()[0]) * 1024
    return (got["VmRSS"], got["VmHWM"]) if len(got) == 2 else None


class Sampler:
    """Every daemon's resident memory every `interval_s`, by peer name, with each phase's peak
    (a restarted daemon is a new process: the sampler follows the pid the run dir names)."""

    def __init__(self, run_dir: Path, interval_s: float = 0.2, floor_bytes: int = 2 << 30):
        self.run_dir, self.interval_s = run_dir, interval_s
        # the machine is shared: below this much available memory the daemons are killed
        self.floor_bytes, self.killed_for_memory = floor_bytes, False
        self.phase = "training"
        self.peaks: dict[str, dict[str, int]] = {}  # phase -> peer -> the largest RSS sampled
        self.hwm: dict[str, int] = {}  # peer -> the kernel's peak RSS of its process (VmHWM), any pid
        self.series: list[tuple[float, str, int]] = []  # (wall time, peer, RSS) of every sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from dtfm.swarm.state import load_state
        while not self._stop.is_set():
            try:
                peers = load_state(self.run_dir).peers
            except Exception:  # (the state file being rewritten)
                peers = []
            for p in peers:
                got = proc_memory(p.pid) if p.pid else None
                if got is not None:
                    peak = self.peaks.setdefault(self.phase, {})
                    peak[p.name] = max(peak.get(p.name, 0), got[0])
                    self.series.append((round(time.time(), 2), p.name, got[0]))
                    self.hwm[p.name] = max(self.hwm.get(p.name, 0), got[1])
            if _available() < self.floor_bytes and not self.killed_for_memory:
                self.killed_for_memory = True
                print(f"only {_available() // MiB} MiB available on this machine: killing the daemons",
                      file=sys.stderr)
                for p in peers:
                    if p.pid:
                        with contextlib.suppress(OSError):
                            os.kill(p.pid, signal.SIGKILL)
            self._stop.wait(self.interval_s)


def _available() -> int:
    """MemAvailable of this machine in bytes (a large number where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def baseline(preset: str, steps: int, batch: int, micro: int) -> dict:
    """One process training the whole model: its peak RSS (the first child this bench waits
    for, so the children's ru_maxrss is its own) and step time."""
    cmd = [sys.executable, "-m", "dtfm.train", "--preset", preset, "--steps", str(steps), "--batch", str(batch),
           "--micro-batches", str(micro), "--log-json", "--quiet"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"python -m dtfm.train failed: {err.strip()[-2000:]}")
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return {"peak_rss_mib": round(_child_peak() / MiB), "step_s": round(rows[-1]["step_s"], 2), "steps": len(rows)}


def _child_peak() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def statuses(run_dir: Path) -> dict[str, dict]:
    from dtfm.swarm.proc import peer_status
    from dtfm.swarm.state import load_state
    return {p.name: ((peer_status(p) or {}).get("training") or {}) for p in load_state(run_dir).peers if p.alive()}


def logged(run_dir: Path) -> list[dict]:
    """The run's step log, merged from every peer's now (as `dtfm-swarm wait` merges it)."""
    from dtfm.swarm.state import load_state
    from dtfm.swarm.train import sync_logs
    return sync_logs(run_dir, load_state(run_dir))[0]


def wait_steps(run_dir: Path, more: int) -> None:
    rows = logged(run_dir)
    target = (rows[-1]["step"] + 1 if rows else 0) + more
    swarm(run_dir, "wait", "--step", str(target), "--timeout", "1800")


def keep_logs(run_dir: Path, log_dir: Path, sampler: Sampler) -> None:
    """The samples and each daemon's log and events, copied to `log_dir` before the swarm goes."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "samples.jsonl", "w") as f:
        for t, name, rss in list(sampler.series):
            f.write(json.dumps({"t": t, "peer": name, "rss_mib": round(rss / MiB, 1)}) + "\n")
    for peer in sorted(run_dir.iterdir()):
        for name in ("daemon.log", "events.jsonl"):
            if (peer / name).is_file():
                shutil.copy(peer / name, log_dir / f"{peer.name}.{name}")


def _trains(t: dict, after_epoch: int) -> bool:
    """A peer's training status says it is placed in an epoch after `after_epoch` (not the
    allocation a restarted daemon restores from its data dir): training a stage, or a spare."""
    return (t.get("state") in ("training", "spare") and not t.get("restored")
            and (t.get("epoch") or 0) > after_epoch)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=3, help="steps before the kill, after it, and after the restart")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--restart-wait-s", type=float, default=300.0,
                    help="how long to wait for the restarted peer to be placed again")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="keep every sample (samples.jsonl: wall time, peer, RSS) and each daemon's log and "
                         "events there, to see what a peak was")
    args = ap.parse_args(argv)

    base = baseline(args.preset, args.steps, args.batch, args.micro_batches)
    print(f"one process: peak {base['peak_rss_mib']} MiB, {base['step_s']} s per step", file=sys.stderr)
    stage_state: dict[str, int] = {}  # peer -> the largest stage state it reported
    reported: dict[str, dict] = {}  # peer -> its last memory report

    def note_states() -> None:
        for name, t in statuses(run_dir).items():
            mem = t.get("memory") or {}
            if mem.get("stage_bytes"):
                stage_state[name] = max(stage_state.get(name, 0), int(mem["stage_bytes"]))
                reported[name] = mem

    with running_swarm("--scenario", "datacenter", "--peers", "4", "--no-emulation", "--timeout", "300",
                       kill=True, prefix="dtfm-mem-") as run_dir, Sampler(run_dir) as sampler:
        swarm(run_dir, "train", "--preset", args.preset, "--stages", "2", "--dp", "2", "--steps", "100000",
              "--batch", str(args.batch), "--micro-batches", str(args.micro_batches), "--checkpoint-every", "2")
        wait_steps(run_dir, args.steps)
        note_states()
        t = statuses(run_dir)
        victim = min(n for n, v in t.items() if v.get("stage") is not None and v.get("role") != "coordinator")
        epoch = max(v.get("epoch") or 0 for v in t.values())
        sampler.phase = "after_kill"
        swarm(run_dir, "kill", victim)
        wait_for("a step of a newer epoch", lambda: any(r["epoch"] > epoch for r in logged(run_dir)), 1800, 2.0)
        wait_steps(run_dir, args.steps)
        note_states()
        epoch = max(r["epoch"] for r in logged(run_dir))
        sampler.phase = "after_restart"
        swarm(run_dir, "restart", victim)
        try:  # (a scheduler that finds the run as fast without it leaves it out: then no transfer here)
            wait_for(f"{victim} to be placed again", lambda: _trains(statuses(run_dir).get(victim, {}), epoch),
                     args.restart_wait_s, 2.0)
            placed_again = statuses(run_dir).get(victim, {}).get("state")
        except RuntimeError:
            placed_again = None
        wait_steps(run_dir, args.steps)
        note_states()
        steps = len(logged(run_dir))
        if args.log_dir is not None:
            keep_logs(run_dir, args.log_dir, sampler)
    peaks = sampler.peaks
    daemons = {}
    for name in sorted(sampler.hwm):
        peak = sampler.hwm[name]
        state = stage_state.get(name)
        daemons[name] = {"peak_rss_mib": round(peak / MiB),
                         **{f"peak_{ph}_mib": round(v[name] / MiB) for ph, v in peaks.items() if name in v},
                         "stage_state_mib": round(state / MiB) if state else None,
                         "peak_over_stage_state": round(peak / state, 2) if state else None,
                         "peak_over_one_process": round(peak / (base["peak_rss_mib"] * MiB), 2),
                         "reported": reported.get(name)}
    print_table(["daemon", "peak MiB", "training", "after kill", "after restart", "stage state MiB", "peak / state",
                 "peak / one process"],
                [[n, d["peak_rss_mib"], d.get("peak_training_mib", "-"), d.get("peak_after_kill_mib", "-"),
                  d.get("peak_after_restart_mib", "-"), d["stage_state_mib"], d["peak_over_stage_state"],
                  d["peak_over_one_process"]] for n, d in daemons.items()])
    ratios = [d["peak_over_stage_state"] for d in daemons.values() if d["peak_over_stage_state"] is not None]
    print(json.dumps({"preset": args.preset, "shape": "2x2", "batch": args.batch, "micro_batches": args.micro_batches,
                      "killed": victim, "restarted_as": placed_again, "steps_logged": steps, "one_process": base, "daemons": daemons,
                      "max_peak_over_stage_state": max(ratios) if ratios else None,
                      "max_peak_mib": max(d["peak_rss_mib"] for d in daemons.values())}))


if __name__ == "__main__":
    main()
