"""What `dtfm-swarm status` and `demo` show: the swarm table, the measured view in scenario
units, and an allocation computed on it."""

from __future__ import annotations

from typing import Any

import numpy as np

from dtfm.sched import ModelSpec, solve

from .proc import peer_status
from .state import SwarmState

# The dtfm.train preset `dtfm-swarm demo` schedules on the measured view and then trains.
DEMO_PRESET = "tiny"


def status_report(state: SwarmState) -> dict:
    """The whole swarm as one JSON-able dict, the measured matrix as seen by one live peer."""
    peers_out = []
    observer = None
    for p in state.peers:
        rep = peer_status(p)
        if rep is not None:
            p.peer_id = str(rep.get("peer_id", p.peer_id))
            observer = observer or rep
        entry = {"name": p.name, "index": p.index, "id": p.peer_id, "region": p.region,
                 "address": p.address, "pid": p.pid,
                 "state": "running" if rep is not None else ("unresponsive" if p.alive() else "stopped")}
        training = (rep or {}).get("training") or {}
        if training.get("epoch") is not None:
            entry.update({"stage": training.get("stage"), "pipeline": training.get("pipeline"),
                          "epoch": training.get("epoch"), "step": training.get("step"),
                          "training": training.get("state")})
        peers_out.append(entry)
    report: dict[str, Any] = {"scenario": state.scenario_name, "run_dir": None,
                              "time_scale": state.time_scale,
                              "bandwidth_scale": state.bandwidth_scale, "peers": peers_out}
    if observer is not None:
        gossip_members = {m.get("id"): m for m in (observer.get("gossip") or {}).get("members", [])}
        for entry in peers_out:
            m = gossip_members.get(entry["id"])
            if m is not None:
                entry["member_state"] = m.get("state")
        report["observer"] = observer.get("peer_id")
        report["measured"] = measured_matrices(observer, [p["id"] for p in peers_out],
                                               state.time_scale, state.bandwidth_scale)
    return report


def measured_matrices(report: dict, ids: list[str], time_scale: float,
                      bandwidth_scale: float) -> dict:
    """The observer's view reordered to `ids`, in scenario units (scales divided out)."""
    view = (report.get("gossip") or {}).get("view") or {}
    order = {pid: k for k, pid in enumerate(view.get("peers", []))}
    raw_delay = view.get("delay_ms") or []
    raw_bw = view.get("bandwidth_gbps") or []
    n = len(ids)

    def pick(matrix: list, i: int, j: int) -> float | None:
        a, b = order.get(ids[i]), order.get(ids[j])
        if a is None or b is None or a >= len(matrix) or b >= len(matrix[a]):
            return None
        return matrix[a][b]

    raw_d = [[pick(raw_delay, i, j) for j in range(n)] for i in range(n)]
    raw_b = [[pick(raw_bw, i, j) for j in range(n)] for i in range(n)]
    # The emulator stretches delays by time_scale and carries bandwidth x bandwidth_scale /
    # time_scale: divide both back out.
    bw_factor = time_scale / bandwidth_scale
    return {
        "delay_ms": [[None if v is None else v / time_scale for v in row] for row in raw_d],
        "bandwidth_gbps": [[None if v is None else v * bw_factor for v in row] for row in raw_b],
        "raw_delay_ms": raw_d,
        "raw_bandwidth_gbps": raw_b,
        "complete": bool(view.get("complete", False)),
    }


def format_status(report: dict) -> str:
    rows = [["NAME", "ID", "REGION", "ADDRESS", "PID", "PROCESS", "MEMBER", "STAGE", "STEP", "TRAINING"]]
    for p in report["peers"]:
        stage = "-" if p.get("stage") is None else f"{p['stage']}/{p['pipeline']}"
        rows.append([p["name"], (p["id"] or "-")[:8], p["region"], p["address"],
                     str(p["pid"] or "-"), p["state"], p.get("member_state", "-"), stage,
                     "-" if p.get("step") is None else str(p["step"]), p.get("training") or "-"])
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = [f"swarm: scenario {report['scenario']}, {len(report['peers'])} peers, "
             f"time scale {report['time_scale']:g}, bandwidth scale {report['bandwidth_scale']:g}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    measured = report.get("measured")
    if measured:
        names = [p["name"] for p in report["peers"]]
        lines.append("")
        lines.append("measured one-way delay (ms) / bandwidth (Gbps), scenario units"
                     + ("" if measured["complete"] else " -- incomplete"))
        width = 11
        lines.append(" " * 5 + "".join(n.rjust(width) for n in names))
        for i, name in enumerate(names):
            cells = []
            for j in range(len(names)):
                d, b = measured["delay_ms"][i][j], measured["bandwidth_gbps"][i][j]
                cells.append(("-" if i == j or d is None or b is None
                              else f"{d:.0f}/{b:.2f}").rjust(width))
            lines.append(name.ljust(5) + "".join(cells))
    return "\n".join(lines)


def demo_model(n_peers: int) -> ModelSpec:
    """train's DEMO_PRESET in the scheduler's terms: 8 sequences per peer per step, in
    micro-batches of 2."""
    from dtfm.train import get_preset  # torch: only the demo pays for importing it

    gpt = get_preset(DEMO_PRESET)
    return ModelSpec(gpt.name, layers=gpt.n_layer, hidden=gpt.n_embd, heads=gpt.n_head,
                     seq_len=gpt.seq_len, vocab=gpt.vocab, micro_batch_size=2,
                     global_batch_seqs=8 * n_peers)


def schedule_measured(report: dict, *, time_budget_s: float = 5.0):
    """Run the scheduler on the swarm's measured view for the demo model."""
    measured = report["measured"]
    delay = np.array([[0.0 if v is None else v for v in row] for row in measured["delay_ms"]])
    bw = np.array([[np.inf if v is None else v for v in row] for row in measured["bandwidth_gbps"]])
    np.fill_diagonal(bw, np.inf)
    spec = demo_model(len(delay))
    regions = [p["region"] for p in report["peers"]]
    # Every peer takes part: with communication alone in the objective, leaving peers out as
    # spares would always look cheaper.
    return solve(delay, bw, spec, stages="auto", regions=regions, time_budget_s=time_budget_s,
                 allow_spares=False)


def format_allocation(report: dict, alloc) -> str:
    names = [f"{p['name']}({p['region']})" for p in report["peers"]]
    lines = [f"allocation on the measured view: {alloc.stages} stages x {alloc.dp} pipelines, "
             f"predicted cost {alloc.cost.paper_s:.3f} s (DP {alloc.cost.dp_s:.3f} + "
             f"2 x PP {alloc.cost.pp_s:.3f})"]
    for k, pipe in enumerate(alloc.pipelines):
        lines.append(f"  pipeline {k}: " + " -> ".join(names[i] for i in pipe))
    if alloc.spares:
        lines.append("  spares: " + ", ".join(names[i] for i in alloc.spares))
    return "\n".join(lines)
