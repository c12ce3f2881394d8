"""A run drawn from its run dir alone: report.txt and loss.png (`dtfm-swarm report`, and the end
of `dtfm-swarm demo`), with no swarm running and no second run.

It reads what the swarm left there: swarm.json (scenario, peers and their regions), run.json
(the request and the allocation `dtfm-swarm train` got), train.jsonl (one line per step) and
events.jsonl (elections and reconfigurations).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from dtfm.peer import plural

from .report import RECONFIG_EVENTS, format_reconfigurations
from .state import STATE_FILE, SwarmError, SwarmState, load_state
from .train import EVENTS_NAME, LOG_NAME, current_run, read_log

__all__ = ["PLOT_NAME", "REPORT_NAME", "RunRecord", "plot_run", "read_run", "report_lines", "write_report"]

REPORT_NAME = "report.txt"
PLOT_NAME = "loss.png"


@dataclass(frozen=True)
class RunRecord:
    """Everything a report says, as read from a run dir."""

    state: SwarmState | None  # None: the run dir has no (readable) swarm.json
    run: dict  # run.json: run_id, started_at, issuer, request, allocation (older ones: the first two)
    steps: list[dict]  # train.jsonl, sorted by step
    events: list[dict]  # events.jsonl, sorted by time

    def peer_name(self, peer_id: str) -> str:
        """p04(Seoul) for a peer of the swarm, else the id's first 8 digits."""
        for p in self.state.peers if self.state is not None else []:
            if p.peer_id and p.peer_id == peer_id:
                return f"{p.name}({p.region})"
        return peer_id[:8]

    @property
    def preset(self) -> str | None:
        return (self.run.get("request") or {}).get("preset")

    @property
    def allocation(self) -> dict:
        return self.run.get("allocation") or {}

    def reconfigurations(self) -> list[dict]:
        return [e for e in self.events if e.get("event") in RECONFIG_EVENTS]


def read_run(run_dir: Path) -> RunRecord:
    """The run dir's record; SwarmError when it holds no run at all."""
    steps = sorted(read_log(run_dir / LOG_NAME), key=lambda r: r.get("step", -1))
    if not steps and not (run_dir / STATE_FILE).exists():
        raise SwarmError(f"no run in {run_dir}: it has no {LOG_NAME} or {STATE_FILE} (pass the --run-dir "
                         f"the swarm ran in)")
    try:
        state: SwarmState | None = load_state(run_dir)
    except SwarmError:
        state = None
    return RunRecord(state, current_run(run_dir), steps, read_log(run_dir / EVENTS_NAME))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def report_lines(rec: RunRecord, plot: Path | None, plot_error: str | None = None) -> list[str]:
    """report.txt, line by line."""
    req, alloc, steps = rec.run.get("request") or {}, rec.allocation, rec.steps
    lines = []
    run_id = rec.run.get("run_id")
    head = [f"run {run_id[:8]}" if isinstance(run_id, str) else "run (id unknown)"]
    if req:
        head.append(f"preset {req.get('preset')}, {req.get('steps')} steps, seed {req.get('seed')}, "
                    f"placement {req.get('placement', 'scheduler')}")
    lines.append(", ".join(head))
    if rec.state is not None:
        lines.append(f"swarm: scenario {rec.state.scenario_name}, {len(rec.state.peers)} peers: "
                     + ", ".join(f"{p.name}({p.region})" for p in rec.state.peers))
    if alloc:
        issuer = rec.run.get("issuer")
        lines.append(f"allocation: {plural(alloc.get('stages'), 'stage')} x {plural(alloc.get('dp'), 'pipeline')}, layers "
                     f"{alloc.get('layer_ranges')}" + (f", issued by {issuer}" if issuer else ""))
        for d, pipe in enumerate(alloc.get("pipelines") or []):
            lines.append(f"  pipeline {d}: " + " -> ".join(rec.peer_name(p) for p in pipe))
        if alloc.get("spares"):
            lines.append("  spares: " + ", ".join(rec.peer_name(p) for p in alloc["spares"]))
    if not steps:
        lines.append("steps: none logged yet")
    else:
        first, last = steps[0], steps[-1]
        losses = [r for r in steps if isinstance(r.get("loss"), (int, float))]
        if losses:
            lines.append(f"loss: {losses[0]['loss']:.4f} at step {losses[0]['step'] + 1} -> "
                         f"{losses[-1]['loss']:.4f} at step {losses[-1]['step'] + 1}")
        undecided = sum(1 for r in steps if r.get("loss_no_majority"))
        if undecided:  # (control/coordinator/steplog.py: no last stage writes the loss alone)
            lines.append(f"loss: none logged for {plural(undecided, 'step')}: the last stages disagreed with "
                         "no majority (loss_no_majority)")
        later = steps[1:]  # the first step also builds the stages
        measured = _median([r["iteration_s"] for r in later if isinstance(r.get("iteration_s"), (int, float))])
        tokens = _median([r["tokens_per_s"] for r in later if isinstance(r.get("tokens_per_s"), (int, float))])
        predicted = alloc.get("predicted_iteration_s", first.get("predicted_iteration_s"))
        lines.append("iteration time: "
                     + (f"predicted {predicted:.3f} s, " if isinstance(predicted, (int, float)) else "")
                     + (f"measured median {measured:.3f} s" if measured is not None else "not measured")
                     + " (first step left out)")
        lines.append(f"throughput: median {tokens:.0f} tokens/s" if tokens is not None
                     else "throughput: not measured")
        started, ended = rec.run.get("started_at"), last.get("time")
        if isinstance(started, (int, float)) and isinstance(ended, (int, float)):
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
            lines.append(f"time: {ended - started:.1f} s from train start ({when}) to step {last['step'] + 1}")
    t0 = rec.run.get("started_at")
    reconf = format_reconfigurations(rec.events, t0 if isinstance(t0, (int, float)) else None)
    lines += reconf or ["reconfigurations: none"]
    if plot is not None:
        lines.append(f"loss plot: {plot}")
    else:
        lines.append(f"loss plot: none ({plot_error or 'no step logged'})")
    return lines


def plot_run(rec: RunRecord, out: Path) -> Path | None:
    """loss.png: loss per step with tokens/s on a second axis, reconfigurations as vertical lines;
    below it, the measured iteration time against the prediction. None when no step has a loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rec.steps if isinstance(r.get("loss"), (int, float))]
    if not rows:
        return None
    fig, (ax, ax_t) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 2))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="loss")
    ax.set_ylabel("loss", color="tab:blue")
    ax_tok = ax.twinx()
    tok = [r for r in rec.steps[1:] if isinstance(r.get("tokens_per_s"), (int, float))]
    ax_tok.plot([r["step"] for r in tok], [r["tokens_per_s"] for r in tok], color="tab:orange", alpha=0.7,
                label="tokens/s")
    ax_tok.set_ylabel("tokens/s", color="tab:orange")
    ax_tok.set_ylim(bottom=0)
    it = [r for r in rec.steps if isinstance(r.get("iteration_s"), (int, float))]
    ax_t.plot([r["step"] for r in it], [r["iteration_s"] for r in it], color="tab:green", label="measured")
    pred = [r for r in rec.steps if isinstance(r.get("predicted_iteration_s"), (int, float))]
    if pred:
        ax_t.step([r["step"] for r in pred], [r["predicted_iteration_s"] for r in pred], where="post",
                  color="tab:gray", linestyle="--", label="predicted (scheduler)")
    ax_t.set_ylabel("iteration time (s)")
    ax_t.set_xlabel("step")
    ax_t.set_ylim(bottom=0)
    marked = False
    for e in rec.reconfigurations():
        at = e.get("resume_step")
        if not isinstance(at, int):
            continue
        for a in (ax, ax_t):
            a.axvline(at, color="tab:red", linestyle=":", linewidth=1.2,
                      label="reconfiguration" if a is ax and not marked else None)
        ax.annotate(f"{e.get('old_shape') or '-'}->{e.get('new_shape') or '-'}", (at, 1.0),
                    xycoords=("data", "axes fraction"), fontsize=7, color="tab:red", ha="left", va="top",
                    rotation=90)
        marked = True
    handles = ax.get_legend_handles_labels()[0] + ax_tok.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax_t.legend(loc="upper right", fontsize=8)
    alloc = rec.allocation
    title = f"preset {rec.preset} on the swarm" if rec.preset else "training on the swarm"
    if rec.state is not None:
        title += f": {len(rec.state.peers)} peers, scenario {rec.state.scenario_name}"
    if alloc.get("stages"):
        title += f", {plural(alloc['stages'], 'stage')} x {plural(alloc.get('dp'), 'pipeline')}"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_report(run_dir: Path) -> list[str]:
    """Write report.txt and loss.png in `run_dir` from its files; returns the report's lines."""
    rec = read_run(run_dir)
    plot, why = None, None
    try:
        plot = plot_run(rec, run_dir / PLOT_NAME)
    except ImportError:
        why = "matplotlib is not installed: install it in dtfm's environment, then `dtfm-swarm report`"
    lines = report_lines(rec, plot, why)
    (run_dir / REPORT_NAME).write_text("\n".join(lines) + "\n")
    return lines
