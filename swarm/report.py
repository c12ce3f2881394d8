"""What `dtfm-swarm status` and `demo` show: the swarm table, the measured view in scenario
units, and an allocation computed on it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dtfm.sched import Allocation, ModelSpec

from dtfm.peer import plural, quorum_lost, reconfiguration_parts

from .proc import peer_status
from .state import SwarmState

# The dtfm.train preset `dtfm-swarm demo` schedules on the measured view and then trains.
DEMO_PRESET = "tiny"


def status_report(state: SwarmState) -> dict:
    """The whole swarm as one JSON-able dict, the measured matrix as seen by one live peer.
    `peers` stay in the scenario's order (the matrices follow it); each says its training
    role, term and whether it is the coordinator, which the report names at the top."""
    peers_out: list[dict[str, Any]] = []
    trainings = []
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
        entry.update({"role": training.get("role"), "term": training.get("term"),
                      "sees_coordinator": training.get("coordinator")})
        peers_out.append(entry)
        trainings.append(training)
    report: dict[str, Any] = {"scenario": state.scenario_name, "run_dir": None,
                              "time_scale": state.time_scale,
                              "bandwidth_scale": state.bandwidth_scale, "peers": peers_out}
    chosen = pick_coordinator(peers_out, trainings)
    for k, entry in enumerate(peers_out):
        entry["coordinator"] = k == chosen
    terms = [e["term"] for e in peers_out if isinstance(e["term"], int)]
    report["coordinator"] = None if chosen is None else peers_out[chosen]["name"]
    issued = (trainings[chosen].get("issued") if chosen is not None else None) or {}
    if isinstance(issued, dict) and issued.get("run_id"):  # the run as its coordinator sees it
        report["run"] = {k: issued.get(k) for k in ("run_id", "state", "completed", "end_step", "reason",
                                                     "stalled_s", "cut_links")}
    report["term"] = (peers_out[chosen]["term"] if chosen is not None and peers_out[chosen]["term"] is not None
                      else max(terms, default=None))
    lost = council_lost(trainings, {p["id"]: p["name"] for p in peers_out if p["id"]})
    if lost is not None:
        report["council_lost"] = lost
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


def pick_coordinator(peers: list[dict], trainings: list[dict]) -> int | None:
    """Index of the swarm's coordinator in `peers`: the peer that says it coordinates at the
    highest term; else the one most peers recognise at the highest term they know; else (older
    daemons, no election) the issuer of the latest run. None when nothing names one."""
    own = [(e["term"] if isinstance(e.get("term"), int) else -1, -k)
           for k, e in enumerate(peers) if e.get("role") == "coordinator"]
    if own:
        return -max(own)[1]
    votes: dict[tuple[int, str], int] = {}
    for e in peers:
        seen = e.get("sees_coordinator")
        if isinstance(seen, str) and seen:
            key = (e["term"] if isinstance(e.get("term"), int) else -1, seen)
            votes[key] = votes.get(key, 0) + 1
    if votes:
        (_, seen), _ = max(votes.items(), key=lambda kv: (kv[0][0], kv[1]))
        for k, e in enumerate(peers):
            if e.get("id") and (seen.startswith(e["id"]) or e["id"].startswith(seen)):
                return k
        return None
    issued = [(float((t.get("issued") or {}).get("started_at") or 0.0), -k)
              for k, t in enumerate(trainings) if isinstance(t.get("issued"), dict)]
    return -max(issued)[1] if issued else None


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


def _row_order(p: dict) -> tuple:
    """Region, then the training peers by stage and pipeline, then spares and idle peers."""
    placed = p.get("stage") is not None
    return (p["region"], not placed, p.get("stage") if placed else 0,
            p.get("pipeline") if placed and p.get("pipeline") is not None else 0, p["name"])


def council_lost(trainings: list[dict], names: dict[str, str]) -> dict | None:
    """The council's loss of its quorum (`dtfm.peer.quorum_lost`) as a peer at the newest term
    of the election sees it, the voters gone by `names` (peer id -> name; else a short id);
    None while it can elect."""
    els: list[dict[str, Any]] = [t["election"] for t in trainings if isinstance(t.get("election"), dict)]
    newest = max((e["term"] for e in els if isinstance(e.get("term"), int)), default=None)
    for e in els:
        lost = quorum_lost(e) if e.get("term") == newest else None
        if lost is not None:
            return {**lost, "gone": [names.get(g, g[:8]) for g in lost["gone"]]}
    return None


def council_lost_text(lost: dict) -> str:
    return (f"council lost its quorum: {lost['live_voters']} of {lost['voters']} voters alive, "
            f"{lost['quorum']} needed (gone: {', '.join(lost['gone']) or '?'}); nothing goes on until they "
            "come back (`dtfm-swarm restart NAME`) or the operator names a new council "
            "(`dtfm-peer train council --data-dir PEER_DIR`)")


def format_status(report: dict) -> str:
    rows = [["REGION", "NAME", "ID", "ROLE", "TERM", "STAGE", "EPOCH", "STEP", "TRAINING",
             "PROCESS", "MEMBER", "ADDRESS", "PID"]]
    for p in sorted(report["peers"], key=_row_order):
        stage = "-" if p.get("stage") is None else f"{p['stage']}/{p['pipeline']}"
        rows.append([p["region"], p["name"] + ("*" if p.get("coordinator") else ""),
                     (p["id"] or "-")[:8], p.get("role") or "-", _dash(p.get("term")), stage,
                     _dash(p.get("epoch")), _dash(p.get("step")), p.get("training") or "-",
                     p["state"], p.get("member_state", "-"), p["address"], _dash(p["pid"])])
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    coordinator = report.get("coordinator")
    lines = [f"swarm: scenario {report['scenario']}, {len(report['peers'])} peers, "
             + (f"coordinator {coordinator}* (term {_dash(report.get('term'))})" if coordinator
                else f"no coordinator known (term {_dash(report.get('term'))})")
             + f", time scale {report['time_scale']:g}, bandwidth scale {report['bandwidth_scale']:g}"]
    run = report.get("run")
    if run:
        completed = run.get("completed")  # the last completed step's index: steps 0..completed are done
        done = completed + 1 if isinstance(completed, int) else None
        line = f"run {str(run['run_id'])[:8]}: {run['state']}, {_dash(done)} of {_dash(run['end_step'])} steps done"
        if isinstance(run.get("stalled_s"), (int, float)):
            line += f", no progress for {run['stalled_s']:.0f} s"
        if run.get("reason"):
            line += f": {run['reason']}"
        if run.get("cut_links"):
            line += f" (cut links: {run['cut_links']})"
        lines.append(line)
    lost = report.get("council_lost")
    if lost:
        lines.append(council_lost_text(lost))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += _format_measured(report)
    return "\n".join(lines)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _format_measured(report: dict) -> list[str]:
    measured = report.get("measured")
    if not measured:
        return []
    names = [p["name"] for p in report["peers"]]
    lines = ["", "measured one-way delay (ms) / bandwidth (Gbps), scenario units"
             + ("" if measured["complete"] else " -- incomplete")]
    width = 11
    lines.append(" " * 5 + "".join(n.rjust(width) for n in names))
    for i, name in enumerate(names):
        cells = []
        for j in range(len(names)):
            d, b = measured["delay_ms"][i][j], measured["bandwidth_gbps"][i][j]
            cells.append(("-" if i == j or d is None or b is None
                          else f"{d:.0f}/{b:.2f}").rjust(width))
        lines.append(name.ljust(5) + "".join(cells))
    return lines


# ---- events ---------------------------------------------------------------------------------

RECONFIG_EVENTS = ("reconfigure", "rollback", "stopped")


def _seconds(value: Any) -> str:
    return f"{value:.3f} s" if isinstance(value, (int, float)) else "?"


def format_event(e: dict, t0: float | None = None) -> str:
    """One line: time (clock time, or +seconds since `t0`), event, term, epoch, trigger, and for
    a reconfiguration the shapes, predicted step times, moves, bytes moved and resume step."""
    at = e.get("time")
    if not isinstance(at, (int, float)):
        when = "?"
    elif t0 is not None:
        when = f"+{at - t0:.1f}s"
    else:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    parts = [when, str(e.get("event", "?")), f"term {_dash(e.get('term'))}", f"epoch {_dash(e.get('epoch'))}"]
    if e.get("trigger"):
        parts.append(str(e["trigger"]))
    reconf = reconfiguration_parts(e, bytes_missing="-")
    if "shape" in reconf:
        parts.append(reconf["shape"])
    if e.get("predicted_old_s") is not None:
        parts.append(f"predicted {_seconds(e['predicted_old_s'])} -> {_seconds(e.get('predicted_new_s'))}")
    elif e.get("predicted_new_s") is not None:
        parts.append(f"predicted {_seconds(e['predicted_new_s'])}")
    parts += [reconf[k] for k in ("moves", "moved") if k in reconf]
    if "resumed" in reconf:
        parts.append(reconf["resumed"])
    if e.get("kind"):
        parts.append(f"({e['kind']})")
    if e.get("reason") and e.get("reason") != e.get("trigger"):
        parts.append(str(e["reason"]))
    if isinstance(e.get("peer"), str) and e["peer"]:
        parts.append(f"by {e['peer'][:8]}")
    return "  ".join(parts)


def format_reconfigurations(events: list[dict], t0: float | None = None) -> list[str]:
    """The report's part on the run's reconfigurations; [] when there were none."""
    reconf = [e for e in events if e.get("event") in RECONFIG_EVENTS]
    elections = [e for e in events if e.get("event") == "coordinator"]
    if not reconf and len(elections) <= 1:
        return []
    lines = [f"reconfigurations: {len(reconf)}; coordinators elected: {len(elections)}"]
    lines += ["  " + format_event(e, t0) for e in events
              if e.get("event") in RECONFIG_EVENTS or e.get("event") in ("coordinator", "stepped-down")]
    return lines


def demo_model(n_peers: int) -> ModelSpec:
    """train's DEMO_PRESET in the scheduler's terms: 8 sequences per peer per step, in
    micro-batches of 2."""
    from dtfm.sched import ModelSpec  # scipy: `status` and `down` need no scheduler
    from dtfm.train import get_preset

    gpt = get_preset(DEMO_PRESET)
    return ModelSpec(gpt.name, layers=gpt.n_layer, hidden=gpt.n_embd, heads=gpt.n_head,
                     seq_len=gpt.seq_len, vocab=gpt.vocab, micro_batch_size=2,
                     global_batch_seqs=8 * n_peers)


def schedule_measured(report: dict, *, time_budget_s: float = 5.0) -> Allocation:
    """Run the scheduler on the swarm's measured view for the demo model."""
    from dtfm.sched import solve

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


def format_allocation(report: dict, alloc: Allocation) -> str:
    names = [f"{p['name']}({p['region']})" for p in report["peers"]]
    lines = [(f"allocation on the measured view: {plural(alloc.stages, 'stage')} x {plural(alloc.dp, 'pipeline')}, "
             f"predicted cost {alloc.cost.paper_s:.3f} s (DP {alloc.cost.dp_s:.3f} + "
             f"2 x PP {alloc.cost.pp_s:.3f})")]
    for k, pipe in enumerate(alloc.pipelines):
        lines.append(f"  pipeline {k}: " + " -> ".join(names[i] for i in pipe))
    if alloc.spares:
        lines.append("  spares: " + ", ".join(names[i] for i in alloc.spares))
    return "\n".join(lines)
