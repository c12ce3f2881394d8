"""The daemon's status report: the fields it always has, and how `dtfm-peer status` prints it.

The report is a plain map (it crosses the control socket as msgpack and prints as JSON):

    peer_id, short_id, listen, advertise, region, pid, data_dir, uptime_s,
    peers:    [{peer_id, short_id, address, region, last_seen_s_ago, connected_for_s}]
    departed: [{peer_id, short_id, address, region, left_s_ago, reason}]
    refused:  {"REASON/TYPE": count} incoming messages refused (malformed, failed, busy, unknown)
    ...       one more key per status provider (Daemon.add_status_provider)
    truncated: [names], only when the report had to be cut to fit its reply frame (fit_report)

Ids are hex text so the JSON form is usable as is.

The report always fits one control reply frame (`socket.max_response_bytes`): each part bounds
itself (gossip lists counts and its first members, `dtfm.gossip.status`), and `fit_report`
cuts whatever is still too big, biggest first: a list keeps its first entries, any other
section becomes `{"truncated": true, "bytes": N}`; the names cut are listed under `truncated`.
"""

from __future__ import annotations

import json
import textwrap
import time
from typing import Any, TypeGuard

from dtfm.net import pack

CORE_KEYS = frozenset({"peer_id", "short_id", "listen", "advertise", "region", "pid", "data_dir",
                       "uptime_s", "peers", "departed", "refused", "truncated", "memory", "loop"})
FORMATTED_KEYS = frozenset({"gossip", "training"})  # sections printed in words, not as JSON

# gossip/view.py's DISAGREEMENT_RATIO, repeated here so that `dtfm-peer status` imports no numpy;
# tests/peer/test_status_format.py checks that the two agree.
DISAGREEMENT_RATIO = 1.5

# Bytes of the reply map around a report ({"ok": true, "result": ...}), with room to spare.
REPLY_OVERHEAD_BYTES = 64


def fit_report(report: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """The report itself when its msgpack encoding takes at most max_bytes; else a copy with
    its biggest sections cut until it does (module docstring). Scalars are never cut, so a
    max_bytes below their size (a few hundred bytes) is not met."""
    if len(pack(report)) <= max_bytes:
        return report
    out = dict(report)
    cut: list[str] = []
    sizes = sorted(((len(pack(v)), k) for k, v in report.items()
                    if isinstance(v, (dict, list)) and k != "truncated"), reverse=True)
    for size, key in sizes:
        out["truncated"] = cut + [key]
        total = len(pack(out))
        value = report[key]
        if isinstance(value, list):
            room = max_bytes - (total - size) - 8  # (8: a longer list header)
            kept: list[Any] = []
            for item in value:
                room -= len(pack(item))
                if room < 0:
                    break
                kept.append(item)
            out[key] = kept
        else:
            out[key] = {"truncated": True, "bytes": size}
        cut.append(key)
        out["truncated"] = list(cut)
        if len(pack(out)) <= max_bytes:
            break
    return out


def format_duration(seconds: float) -> str:
    """`0.4s`, `12s`, `3m 05s`, `2h 03m`, `1d 04h`."""
    if seconds < 0:
        seconds = 0.0
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in [header, *rows]]


def quorum_lost(election: object) -> dict | None:
    """The election status's account of a council that lost its quorum (gossip holds fewer of
    its voters alive than a quorum: no coordinator can be elected): {live_voters, quorum,
    voters, gone (their ids)}; None while it can elect, or when the status does not say."""
    if not isinstance(election, dict):
        return None
    live, quorum, voters = election.get("live_voters"), election.get("quorum"), election.get("voters")
    if not (isinstance(live, int) and isinstance(quorum, int) and isinstance(voters, int)) or live >= quorum:
        return None
    gone = election.get("gone_voters")
    return {"live_voters": live, "quorum": quorum, "voters": voters,
            "gone": [g for g in gone if isinstance(g, str)] if isinstance(gone, list) else []}


def council_lines(election: dict, pad: str) -> list[str]:
    """What an operator must do when the council lost its quorum: nothing else can end that wait."""
    lost = quorum_lost(election)
    if lost is None:
        return []
    names = ", ".join(short(g) for g in lost["gone"])
    return [f"{pad}council lost its quorum: {lost['live_voters']} of its {lost['voters']} voters alive, "
            f"{lost['quorum']} needed to elect a coordinator" + (f" (gone: {names})" if names else ""),
            f"{pad}  no run can go on until they come back or the operator names a new council: "
            "`dtfm-peer train council`"]


def format_text(report: dict[str, Any], now: float | None = None) -> str:
    """Human-readable status, as `dtfm-peer status` prints it: the daemon, its connections,
    gossip's members and this peer's links as a table, any other section as one JSON line, and
    the training section last, in words (`format_training`; `now`: wall time, for the ages)."""
    lines = [
        f"peer      {report.get('short_id', '?')}  ({report.get('peer_id', '?')})",
        f"listen    {report.get('listen', '?')}",
        f"advertise {report.get('advertise') or '- (waiting for a peer to confirm an address)'}",
        f"region    {report.get('region') or '-'}",
        f"uptime    {format_duration(float(report.get('uptime_s', 0)))}",
        f"data dir  {report.get('data_dir', '?')}",
    ]
    memory = format_memory(report)
    if memory:
        lines.append(f"memory    {memory}")
    loop = format_loop(report.get("loop"))
    if loop:
        lines.append(f"loop      {loop}")
    peers = report.get("peers") or []
    lines.append(f"peers     {len(peers)} connected")
    if peers:
        rows = [[p["short_id"], p["address"], p.get("region") or "-",
                 format_duration(p["last_seen_s_ago"]) + " ago",
                 format_duration(p["connected_for_s"])] for p in peers]
        lines += _table(["PEER", "ADDRESS", "REGION", "LAST SEEN", "CONNECTED FOR"], rows)
    departed = report.get("departed") or []
    if departed:
        lines.append(f"departed  {len(departed)}")
        rows = [[p["short_id"], p["address"], p.get("region") or "-",
                 format_duration(p["left_s_ago"]) + " ago", p.get("reason") or "-"]
                for p in departed]
        lines += _table(["PEER", "ADDRESS", "REGION", "LEFT", "REASON"], rows)
    refused = report.get("refused") or {}
    if refused and not refused.get("truncated"):
        lines.append(f"refused   {sum(refused.values())} incoming messages: "
                     + ", ".join(f"{k} x{n}" for k, n in refused.items()))
    truncated = report.get("truncated") or []
    if truncated:
        lines.append(f"truncated {', '.join(map(str, truncated))} (too big for one reply: see the counts)")
    gossip = report.get("gossip")
    if _in_words(gossip):
        lines += format_gossip(gossip, report.get("peer_id"))
    for key in sorted(k for k in report if k not in CORE_KEYS):
        value = report[key]
        if key in FORMATTED_KEYS and _in_words(value):
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=_json_default,
                                                                 sort_keys=True)
        lines.append(f"{key:<9} {text}")
    training = report.get("training")
    if _in_words(training):
        lines += format_training(training, time.time() if now is None else now)
    return "\n".join(lines)


def format_memory(report: dict[str, Any]) -> str:
    """The process's resident memory now and at its peak, and the peak against the stage's own
    state when the peer holds a stage (the training section's `memory`); "" when not reported."""
    mem = report.get("memory")
    if not isinstance(mem, dict):
        return ""
    peak = mem.get("peak_rss_bytes")
    text = f"resident {format_bytes(mem.get('rss_bytes'), missing='?')}, peak {format_bytes(peak, missing='?')}"
    training = report.get("training")
    stage = training.get("memory") if isinstance(training, dict) else None
    state = stage.get("stage_bytes") if isinstance(stage, dict) else None
    if isinstance(state, int) and state > 0 and isinstance(peak, int):
        text += f" ({peak / state:.2f}x the stage's state)"
    data = training.get("data_bytes") if isinstance(training, dict) else None
    if isinstance(data, int):
        text += f"; data set {format_bytes(data)}"
    return text


def format_loop(loop: object) -> str:
    """The event loop's lateness (peer/loopwatch.py) in words; "" when not reported."""
    if not isinstance(loop, dict):
        return ""
    text = f"late by {loop.get('late_ms_worst_1m', '?')} ms at worst in the last minute"
    stalls = loop.get("stalls")
    if not isinstance(stalls, int) or stalls <= 0:
        return text
    text += f"; {stalls} stall{'s' if stalls != 1 else ''} of {loop.get('stall_ms', '?')} ms or more"
    last = loop.get("last_stall")
    if isinstance(last, dict):
        stack = last.get("stack")
        frames = [f for f in stack if isinstance(f, str)] if isinstance(stack, list) else []
        inner = next((f for f in reversed(frames) if f.startswith("dtfm/")), frames[-1] if frames else None)
        where = f" in {inner}" if inner else ""
        text += f", the last {last.get('late_s', '?')} s{where}"
        at = last.get("at")
        if isinstance(at, (int, float)):
            text += f" at {time.strftime('%H:%M:%S', time.gmtime(at))} UTC"
    return text


def format_stage_memory(mem: dict) -> str:
    """The training section's `memory` (the stage's own state) in words."""
    parts = [f"{name} {format_bytes(mem.get(key))}" for name, key in (
        ("weights", "weights_bytes"), ("gradients", "grads_bytes"), ("optimizer", "optimizer_bytes"),
        ("snapshot", "snapshot_bytes"), ("activations", "activations_bytes"))]
    return f"stage state {format_bytes(mem.get('stage_bytes'))}: " + ", ".join(parts)


def format_status_text(report: dict[str, Any], now: float | None = None) -> str:
    """What `dtfm-peer status` prints (`format_text`; `now`: wall time, for the ages)."""
    return format_text(report, now)


def _in_words(section: object) -> TypeGuard[dict[str, Any]]:
    """A section printed in words: a map the daemon did not cut (fit_report)."""
    return isinstance(section, dict) and section.get("truncated") is not True


def _map(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# ---- gossip: members and links ----------------------------------------------------------------

DISPUTED_LEGEND = (
    "(disputed: the two ends of the link measured it more than {ratio}x apart, in round trip or "
    "bandwidth; the scheduler takes the worse of the two figures, so a disputed link can only look "
    "slower than it is. On one machine or a LAN this is measurement noise (sub-millisecond round "
    "trips and CPU-bound transfers vary that much) and harmless; between distant machines it means "
    "an asymmetric path or a peer whose figures are off.)")
ONE_SIDED_LEGEND = "(one-sided: the other end has not reported its measurement of the link yet; this end's is used.)"


def _wrap(text: str, width: int = 100) -> list[str]:
    return ["  " + line for line in textwrap.wrap(text, width - 2)]


def format_ms(ms: object) -> str:
    """A round trip: `0.21 ms`, `4.5 ms`, `130 ms`; `-` unknown."""
    if not isinstance(ms, (int, float)) or not ms > 0:
        return "-"
    if ms < 1:
        return f"{ms:.2f} ms"
    if ms < 10:
        return f"{ms:.1f} ms"
    return f"{ms:.0f} ms"


def format_gbps(gbps: object) -> str:
    """A bandwidth: `1.9 Gbps`, `350 Mbps`; `-` unknown (not measured yet)."""
    if not isinstance(gbps, (int, float)) or not gbps > 0:
        return "-"
    if gbps >= 10:
        return f"{gbps:.0f} Gbps"
    if gbps >= 1:
        return f"{gbps:.1f} Gbps"
    mbps = gbps * 1000
    return f"{mbps:.0f} Mbps" if mbps >= 10 else f"{mbps:.1f} Mbps"


def _link_note(row: dict[str, Any]) -> str:
    state = row.get("link")
    if state == "disputed":
        on = row.get("disputed_on") or []
        parts = []
        if "rtt" in on:
            parts.append(f"rtt {format_ms(row.get('rtt_ms'))} here, {format_ms(row.get('peer_rtt_ms'))} there")
        if "bandwidth" in on:
            parts.append(f"bandwidth {format_gbps(row.get('bandwidth_gbps'))} here, "
                         f"{format_gbps(row.get('peer_bandwidth_gbps'))} there")
        return "disputed" + (": " + "; ".join(parts) if parts else "")
    return str(state) if isinstance(state, str) else "-"


def format_gossip(gossip: dict[str, Any], me: object = None) -> list[str]:
    """Gossip's part of the status (dtfm.gossip.status) as lines: the members by state, then
    this peer's links as a table (peer, region, round trip, bandwidth, when measured, whether
    the two ends agree), a legend for the words in it, and the swarm view's counts."""
    counts = _map(gossip.get("counts"))
    members = [m for m in gossip.get("members") or [] if isinstance(m, dict)]
    total = counts.get("total", len(members))
    states = ", ".join(f"{n} {state}" for state, n in counts.items() if state != "total" and n)
    lines = [f"members   {total} known" + (f": {states}" if states else "")
             + " (dtfm-peer members lists them)"]
    refused = {str(k): n for k, n in _map(gossip.get("refused")).items() if isinstance(n, int) and n > 0}
    if refused:  # (floods: rates and caps per address group, a full table)
        lines.append(f"refused   {sum(refused.values())} membership updates: "
                     + ", ".join(f"{n} {reason}" for reason, n in sorted(refused.items(), key=lambda kv: -kv[1])))
    by_short = {str(m.get("short_id")): m for m in members}
    latency = [r for r in gossip.get("latency") or [] if isinstance(r, dict)]
    measured = {str(r.get("target")) for r in latency}
    alive = [m for m in members if m.get("state") == "alive" and m.get("id") != me]
    unmeasured = [m for m in alive if str(m.get("short_id")) not in measured]
    view = _map(gossip.get("view"))
    head = f"links     {len(latency)} measured by this peer"
    if unmeasured:
        head += f", {len(unmeasured)} not yet"
    if view:
        # the view counts ordered pairs (a link measured from either end counts twice)
        known, expected = view.get("measured_links"), view.get("expected_links")
        disputed = view.get("disputed")
        estimated = view.get("estimated_links")
        head += (f"; swarm-wide {known // 2 if isinstance(known, int) else '?'} of "
                 f"{expected // 2 if isinstance(expected, int) else '?'} peer pairs measured"
                 + (f", {estimated // 2} estimated" if isinstance(estimated, int) and estimated else ""))
        if isinstance(disputed, list) and disputed:
            more = "+" if "view.disputed" in (gossip.get("truncated") or []) else ""
            head += f", {len(disputed)}{more} disputed"
    lines.append(head)
    rows = []
    for r in latency:
        short = str(r.get("target"))
        m = by_short.get(short, {})
        ago = r.get("measured_s_ago")
        rows.append([short, str(m.get("region") or "-"), format_ms(r.get("rtt_ms")),
                     format_gbps(r.get("bandwidth_gbps")),
                     format_duration(float(ago)) + " ago" if isinstance(ago, (int, float)) else "-",
                     _link_note(r)])
    for m in unmeasured:
        rows.append([str(m.get("short_id")), str(m.get("region") or "-"), "-", "-", "never", "not measured yet"])
    if rows:
        lines += _table(["PEER", "REGION", "RTT", "BANDWIDTH", "MEASURED", "LINK"], rows)
    shown = {r.get("link") for r in latency}
    if "disputed" in shown or (view and view.get("disputed")):
        lines += _wrap(DISPUTED_LEGEND.format(ratio=DISAGREEMENT_RATIO))
    if "one-sided" in shown:
        lines += _wrap(ONE_SIDED_LEGEND)
    if "latency" in (gossip.get("truncated") or []):
        lines.append(f"  (the daemon listed the first {len(latency)} of its links)")
    compute = gossip.get("compute_ms")
    if isinstance(compute, (int, float)) and compute > 0:
        share = gossip.get("compute_share")
        at = (f", at {share:.2f} of a core (this machine's other work took the rest)"
              if isinstance(share, (int, float)) and 0 < share < 0.95 else "")
        lines.append(f"compute   {compute:.1f} ms per reference block (forward and backward; measured at start, "
                     f"then from this peer's own training steps{at})")
    return lines


# ---- training ----------------------------------------------------------------------------------

def step_no(index: object) -> object:
    """A step as people count it: the daemons number steps from 0 (`step` 25 is the 26th),
    every text for people from 1, as `train status` prints them (`step 26/100`)."""
    return index + 1 if isinstance(index, int) else index


def format_resume(resume_step: object, rollback: bool = False) -> str:
    """Where a run went on, for people: `resume_step` is the daemons' index of the next step,
    which is the number of steps done: `resumed after step 26` (the next line is step 27),
    `rolled back, resumed after step 20`, `resumed from its first step`."""
    where = (f"after step {resume_step}" if not isinstance(resume_step, int) or resume_step > 0
             else "from its first step")
    return ("rolled back, resumed " if rollback else "resumed ") + where


def plural(n: object, word: str) -> str:
    """`1 stage`, `2 stages`, `? stages`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def short(peer_id: object) -> str:
    return peer_id[:8] if isinstance(peer_id, str) and peer_id else "-"


def format_bytes(n: object, missing: str = "? bytes") -> str:
    """A byte count for people (kB = 1000 bytes); `missing` when it is not a number."""
    if not isinstance(n, (int, float)):
        return missing
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"  # pragma: no cover


def reconfiguration_parts(r: dict, bytes_missing: str = "? bytes") -> dict[str, str]:
    """The parts of a reconfiguration record (the coordinator's answer to a reschedule, an event
    of the run's log, a status's last reconfiguration) for people, each only where its fields
    are given: `shape` (`2x4 -> 2x3`, `-` for a missing side), `moves` (`2 moves`), `moved`
    (`12.5 MB moved`, `bytes_missing` when not a number) and `resumed` (format_resume's)."""
    parts = {}
    if r.get("old_shape") is not None or r.get("new_shape") is not None:
        parts["shape"] = f"{r.get('old_shape') or '-'} -> {r.get('new_shape') or '-'}"
    if r.get("moves") is not None:
        parts["moves"] = f"{r['moves']} moves"
    if r.get("bytes_moved") is not None:
        parts["moved"] = f"{format_bytes(r['bytes_moved'], missing=bytes_missing)} moved"
    if r.get("resume_step") is not None:
        parts["resumed"] = format_resume(r["resume_step"], bool(r.get("rollback")))
    return parts


def steps_done(completed: object) -> object:
    """Steps done when `completed` (a step index, -1: none) is the last one: steps start at 0."""
    return completed + 1 if isinstance(completed, int) else "?"


# What each state of the training section means, where its one word needs saying.
STATE_NOTES = {
    "waiting": "this daemon restarted and holds no stage of the run it was placed in: the coordinator "
               "reconfigures the run around it",
    "spare": "placed in no pipeline of the run: it takes over a stage when the run is reconfigured",
    "paused": "the run waits for a peer that holds a missing stage to come back",
    "stalled": "the run's step is overdue",
}


def format_training(t: dict, now: float) -> list[str]:
    """The status report's `training` map as lines: state and place in the run, the election
    (role, term, coordinator), the last reconfiguration, the last step and, on the
    coordinator, the run's progress. Every field is optional (older or idle daemons)."""
    pad = " " * 10
    state = str(t.get("state", "?"))
    head = [state]
    if t.get("run_id"):
        head.append(f"run {short(t['run_id'])}")
    if t.get("preset"):
        head.append(f"{t['preset']}, {plural(t.get('stages', '?'), 'stage')} x "
                    f"{plural(t.get('dp', '?'), 'pipeline')}")
    if t.get("epoch") is not None:
        head.append(f"epoch {t['epoch']}")
    if t.get("stage") is not None:
        head.append(f"stage {t['stage']} of pipeline {t.get('pipeline')}")
    if t.get("step") is not None:
        head.append(f"last step {step_no(t['step'])}")
    lines = ["training  " + ", ".join(head)]
    if t.get("restored"):
        lines.append(f"{pad}(restored after this daemon restarted: the last allocation it applied, from its data "
                     "dir; a new one replaces it)")
    ended = t.get("run_ended")
    if isinstance(ended, dict):
        lines.append(f"{pad}(the run {ended.get('state')} while this daemon was down, its coordinator says: "
                     f"{ended.get('steps_done')} of {plural(t.get('end_step', '?'), 'step')} done)")
    if state in STATE_NOTES and not (state == "waiting" and not t.get("restored")):
        lines.append(f"{pad}({state}: {STATE_NOTES[state]})")
    if t.get("compression"):
        lines.append(f"{pad}compression {t['compression']}"
                     + (f": {t['compression_details']}" if t.get("compression_details") else ""))
    if any(t.get(k) is not None for k in ("role", "term", "coordinator")):
        coordinator, term = t.get("coordinator"), t.get("term", "-")
        election = t.get("election")
        election = election if isinstance(election, dict) else {}
        heard = election.get("heard_of")
        if coordinator:
            who = short(coordinator)
        elif isinstance(heard, str) and heard and election.get("voters"):
            who = f"{short(heard)} (as its peers say; outside its council, this peer does not follow it)"
        elif isinstance(heard, str) and heard:
            who = (f"{short(heard)} (as its peers say; this peer holds no council to check it against until it "
                   "is handed its first allocation)")
        elif term == 0 and election.get("voters"):
            who = "none yet (one is elected at the swarm's first `train start`)"
        elif term == 0:
            who = ("none known to this peer (it holds no council: a swarm has no coordinator before its first "
                   "`train start`, and a peer that joined later learns it with the first allocation it is handed)")
        else:
            who = "unknown (none heard from in this term)"
        lines.append(f"{pad}role {t.get('role') or '-'}, term {term}, coordinator {who}")
        lines += council_lines(election, pad)
    wait = t.get("waiting_for_peers")
    if isinstance(wait, dict):
        lines.append(f"{pad}train start waits for {wait.get('want', '?')} peers: {wait.get('live', '?')} live, "
                     f"{wait.get('have', '?')} measured")
    reconf = t.get("last_reconfig")
    if isinstance(reconf, dict):
        at = reconf.get("at")
        ago = format_duration(now - at) + " ago" if isinstance(at, (int, float)) else "at an unknown time"
        parts = reconfiguration_parts(reconf)
        lines.append(f"{pad}last reconfiguration: {ago} {reconf.get('reason') or 'no reason given'}: "
                     + ", ".join([parts.get("shape", "- -> -"), parts.get("moved", "? bytes moved")]
                                 + ([parts["resumed"]] if "resumed" in parts else [])))
    last = t.get("last_step")
    if isinstance(last, dict):
        loss = last.get("loss")
        sent = last.get("bytes_sent")
        lines.append(f"{pad}last step {step_no(last.get('step'))}: "
                     + (f"loss {loss:.4f}, " if isinstance(loss, (int, float)) else "")
                     + f"{last.get('iteration_s', 0.0):.3f} s"
                     + (", sent " + ", ".join(f"{k} {format_bytes(v)}" for k, v in sent.items())
                        if isinstance(sent, dict) else ""))
    memory = t.get("memory")
    if isinstance(memory, dict):
        lines.append(f"{pad}{format_stage_memory(memory)}")
    issued = t.get("issued")
    if isinstance(issued, dict):
        lines.append(f"{pad}{format_issued(issued)}")
    end = t.get("last_end")
    if isinstance(end, dict):
        lines.append(f"{pad}{format_epoch_end(end, t)}")
    disk = t.get("checkpoints")
    if isinstance(disk, dict) and (disk.get("bytes") or disk.get("refusal")):
        lines.append(f"{pad}{format_checkpoints(disk)}")
    return lines


def format_checkpoints(disk: dict) -> str:
    """`checkpoints 3.1 MB on disk (the newest 3 per stage of each run kept)`, and the last write
    the disk refused, until one succeeds."""
    runs = disk.get("runs_kept")
    of_runs = f", of the newest {plural(runs, 'run')}" if runs else ""
    line = (f"checkpoints {format_bytes(disk.get('bytes') or 0)} on disk (the newest {disk.get('kept', '?')} per "
            f"stage of each run kept{of_runs}) in {disk.get('path', '?')}")
    if disk.get("refusal"):
        line += f"; REFUSED ({disk.get('refused', 1)} so far): {disk['refusal']}"
    return line


def format_issued(issued: dict) -> str:
    """The run this peer issued as coordinator: `issued run R: finished, all 300 steps done`,
    `issued run R: stopped, 123 of 300 steps done (why)`."""
    state = issued.get("state")
    done = issued.get("steps_done", steps_done(issued.get("completed")))
    end_step = issued.get("end_step")
    if state == "finished" and done == end_step:
        progress = f"all {plural(end_step, 'step')} done"
    else:
        progress = f"{done} of {plural(end_step, 'step')} done"
    stalled = issued.get("stalled_s")
    if isinstance(stalled, (int, float)):
        progress += f", no progress for {format_duration(stalled)}"
    return (f"issued run {short(issued.get('run_id'))}: {state}, {progress}"
            + (f" ({issued['reason']})" if issued.get("reason") else "")
            + (f", step log {issued['log']}" if issued.get("log") else "")
            + format_left_out(issued.get("left_out")) + format_kept_out(issued.get("kept_out")))


def format_kept_out(kept: object) -> str:
    """`; outside the run: 8f6efe7f (the run is not faster with it)`: joined peers the
    scheduler keeps out, not stopping the run for them."""
    if not isinstance(kept, list) or not kept:
        return ""
    names = [short(p) for p in kept if isinstance(p, str)]
    return (f"; outside the run: {', '.join(names)} (the run is not faster with "
            f"{'it' if len(names) == 1 else 'them'})") if names else ""


def format_left_out(left: object) -> str:
    """`; left out: 8f6efe7f (busy: ..., for 30 s)`: the peers the coordinator does not place
    because they refused an allocation, why, and the back-off each got."""
    if not isinstance(left, list) or not left:
        return ""
    parts = []
    for x in left:
        if not isinstance(x, dict):
            continue
        since, until = x.get("since"), x.get("until")
        span = (f", for {format_duration(until - since)}" if isinstance(since, (int, float))
                and isinstance(until, (int, float)) and until >= since else "")
        parts.append(f"{short(x.get('peer'))} ({x.get('code')}: {str(x.get('reason'))[:120]}{span})")
    return "; left out: " + ", ".join(parts) if parts else ""


def format_epoch_end(end: dict, t: dict) -> str:
    """How this peer's last epoch ended. An epoch is one allocation of a run: a failed one is
    usually followed by a reconfiguration, so the line names the epoch, never 'the run'."""
    epoch, completed, reason = end.get("epoch"), end.get("completed"), end.get("reason", "?")
    after = f"after step {completed + 1}" if isinstance(completed, int) and completed >= 0 else "before its first step"
    current = t.get("epoch")
    if not end.get("failed"):
        if reason == "finished":
            what = "the run finished"
        elif reason == "stopped" and t.get("run_stopped"):
            what = "the run was stopped"
        elif reason == "stopped":
            what = "stopped at a step boundary for a reconfiguration of the run"
        else:
            what = str(reason)
        return f"epoch {epoch} ended {after}: {what}"
    line = f"epoch {epoch} was cut short {after}: {reason}"
    if isinstance(current, int) and isinstance(epoch, int) and current > epoch:
        line += f" (the run went on in epoch {current})"
    elif t.get("run_stopped"):
        line += " (the run is stopped)"
    elif t.get("state") not in ("paused", "refused", "finished"):
        line += " (the run's coordinator reconfigures it, unless it was stopped)"
    return line


def _json_default(obj: object) -> object:
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).hex()
    return str(obj)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, default=_json_default, indent=2, sort_keys=True)
