"""`dtfm-peer train status [--follow] [RUN]`: a run's progress, from its coordinator, on any
daemon.

The local daemon answers `train_status` (peer/services.py) with the coordinator's account of its
run (control/progress.py): it asks the coordinator over the transport when it is not the
coordinator itself. `follow` polls it every `poll_s`, asking only for the steps after the last
one printed, and prints each new step (step, loss, step time, tokens/s, epoch, ETA), each new
reconfiguration, and the run's end (after an operator's stop, once the steps up to the stop's
boundary, which the peers still run, are printed); without `--follow` it prints the state and
the last lines once. With `--json` and `--follow`, every line is one JSON object with a
`record` field: `run` (the header: state, term, epoch, shape, steps done, ...), `step`,
`reconfiguration`, and `end` last; without `--follow`, the one answer as it came. Formatting is
pure (`format_*`, `*_record`) and the client is passed in, so tests drive it with a fake daemon
and a fake clock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TextIO

from .status import format_duration, format_resume

__all__ = ["ASK_COORDINATOR_S", "FOLLOW_POLL_S", "end_record", "follow", "format_header", "format_reconfig",
           "format_step", "header_record"]

FOLLOW_POLL_S = 1.0  # one question to the daemon (and from it to the coordinator) per second
ASK_COORDINATOR_S = 30.0  # what a client allows beyond its socket timeout: the daemon finds and asks the coordinator
LAST_LINES = 10  # lines printed without --follow, and when following starts
# After an operator's stop the peers run up to its boundary (two steps on): polls without a new
# step that --follow waits for those steps before it ends (a peer lost meanwhile never logs them)
STOP_WAIT_POLLS = 30


def _num(x: Any, fmt: str, none: str = "-") -> str:
    return none if not isinstance(x, (int, float)) else format(x, fmt)


def format_header(p: dict) -> str:
    """One line: the run, its state, term, epoch, shape, steps done, throughput and ETA."""
    parts = [f"run {p['run'][:8]}: {p['state']}", f"term {p['term']}", f"epoch {p['epoch']}",
             f"{p['shape']} (stages x pipelines)", f"{p['completed']} of {p['steps']} steps"]
    if p.get("tokens_per_s"):
        parts.append(f"last step {p['tokens_per_s']:.0f} tokens/s")
    if p.get("eta_s") is not None:
        parts.append(f"ETA {format_duration(p['eta_s'])}")
    parts.append(f"coordinator {p['coordinator'][:8]}")
    text = ", ".join(parts)
    return text + (f": {p['reason']}" if p.get("reason") else "")


def format_step(line: dict, steps: int, eta_s: float | None) -> str:
    """`step 41/100  loss 3.2101  0.84 s  1234 tokens/s  epoch 3  ETA 52s` (steps count from 1)."""
    text = (f"step {line['step'] + 1}/{steps}  loss {_num(line.get('loss'), '.4f')}  "
            f"{_num(line.get('iteration_s'), '.2f')} s  {_num(line.get('tokens_per_s'), '.0f')} tokens/s  "
            f"epoch {line['epoch']}")
    return text + (f"  ETA {format_duration(eta_s)}" if eta_s is not None else "")


def format_reconfig(r: dict) -> str:
    """`reconfigured (epoch 4, shrink): 2x2 -> 2x1, resumed after step 40: peer 1a2b3c4d is dead`
    (the next step printed is step 41)."""
    text = (f"reconfigured (epoch {r['epoch']}, {r['kind']}): {r['old_shape']} -> {r['new_shape']}, "
            f"{format_resume(r['resume_step'], bool(r.get('rollback')))}")
    return text + (f": {r['reason']}" if r.get("reason") else "")


def header_record(p: dict) -> dict:
    """The header as a JSON line of `--follow --json`: the answer without its step lines and
    reconfigurations (each of those is a line of its own), tagged `"record": "run"`."""
    return {"record": "run", **{k: v for k, v in p.items() if k not in ("lines", "reconfigurations")}}


def end_record(p: dict) -> dict:
    """The run's end as a JSON line of `--follow --json`: `"record": "end"`, with the run, its state,
    the steps done of all and why it ended."""
    return {"record": "end", "run": p["run"], "state": p["state"], "completed": p["completed"],
            "steps": p["steps"], "reason": p.get("reason") or ""}


def _end(p: dict) -> str:
    if p["state"] == "finished":
        return f"run {p['run'][:8]} finished: all {p['steps']} steps"
    return f"run {p['run'][:8]} {p['state']} after {p['completed']} of {p['steps']} steps" + (
        f": {p['reason']}" if p.get("reason") else "")


def _short_of_stop(p: dict) -> bool:
    """A run an operator stopped whose peers still run the steps up to the stop's boundary."""
    stop = p.get("stop_step")
    return p["state"] == "stopped" and isinstance(stop, int) and p["completed"] < stop


def follow(request: Callable[[dict], dict], out: TextIO, *, run: str | None = None, keep_following: bool = False,
           as_json: bool = False, poll_s: float | None = None, sleep: Callable[[float], None] | None = None) -> int:
    """Print the run's progress (see the module docstring); `request(args)` asks the daemon.
    Returns the exit status: 0 (a finished or stopped run included)."""
    args: dict = {"run": run, "after": -1}
    p = request(args)
    if as_json and not keep_following:
        print(json.dumps(p, sort_keys=True), file=out)
        return 0
    run = p["run"]
    print(json.dumps(header_record(p), sort_keys=True) if as_json else format_header(p), file=out, flush=True)
    seen_reconfigs: set[tuple] = set()
    last = -1
    first = True
    quiet = 0  # polls in a row without a new step
    while True:
        lines = p["lines"][-LAST_LINES:] if first else p["lines"]
        for r in p["reconfigurations"]:
            key = (r["epoch"], r["at"])
            if key not in seen_reconfigs:
                seen_reconfigs.add(key)
                print(json.dumps({"record": "reconfiguration", **r}, sort_keys=True) if as_json
                      else format_reconfig(r), file=out)
        for line in lines:
            print(json.dumps({"record": "step", **line}, sort_keys=True) if as_json
                  else format_step(line, p["steps"], p.get("eta_s")), file=out)
            last = max(last, line["step"])
        out.flush()
        quiet = 0 if lines else quiet + 1
        first = False
        if not keep_following:
            return 0
        if p["state"] in ("finished", "stopped", "refused") and not (_short_of_stop(p) and quiet < STOP_WAIT_POLLS):
            print(json.dumps(end_record(p), sort_keys=True) if as_json else _end(p), file=out, flush=True)
            return 0
        (sleep or time.sleep)(FOLLOW_POLL_S if poll_s is None else poll_s)
        args = {"run": run, "after": last}
        p = request(args)
