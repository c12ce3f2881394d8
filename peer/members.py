"""`dtfm-peer members`: every member of the swarm the local daemon knows, with its role in the
run, from the daemon's status (its gossip member table and the allocation it applied).

Pure functions over the status report (a plain map, see peer/status.py), so the command needs
no import beyond the control socket's: `member_rows(report)` joins the two sections,
`format_members(rows)` prints them as a table.

A row: id, short_id, state (gossip's: alive, suspect, unconfirmed, dead, left), region,
address, roles (any of coordinator, voter, stage, spare: the election's coordinator as this
daemon knows it; the voters, stages and spares of the allocation it applied), stage and
pipeline (None unless the allocation places the member at a stage), layers, and `me` (the
daemon asked).
"""

from __future__ import annotations

from typing import Any

from .status import plural

__all__ = ["ROLES", "format_members", "member_rows"]

ROLES = ("coordinator", "voter", "stage", "spare")


def _hex_list(value: object) -> list[str]:
    return [x for x in value if isinstance(x, str)] if isinstance(value, list) else []


def _map(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def member_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The members of the report's gossip table (the daemon itself included), each with its
    roles in the run this daemon applied; named peers gossip no longer lists come last, with
    state "unknown"."""
    gossip, training = _map(report.get("gossip")), _map(report.get("training"))
    me = report.get("peer_id") if isinstance(report.get("peer_id"), str) else ""
    coordinator = training.get("coordinator") if isinstance(training.get("coordinator"), str) else None
    voters = set(_hex_list(training.get("voters")))
    spares = set(_hex_list(training.get("spares")))
    ranges = _list(training.get("layer_ranges"))
    place: dict[str, tuple[int, int]] = {}
    pipelines = _list(training.get("pipelines"))
    for d, pipe in enumerate(pipelines):
        for s, p in enumerate(_hex_list(pipe)):
            place[p] = (s, d)

    rows: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(peer: str, state: str, region: str, address: str) -> None:
        seen.add(peer)
        roles = [r for r, has in (("coordinator", peer == coordinator), ("voter", peer in voters),
                                  ("stage", peer in place), ("spare", peer in spares)) if has]
        stage, pipeline = place.get(peer, (None, None))
        layers = ranges[stage] if stage is not None and stage < len(ranges) else None
        rows.append({"id": peer, "short_id": peer[:8], "state": state, "region": region, "address": address,
                     "roles": roles, "stage": stage, "pipeline": pipeline, "layers": layers, "me": peer == me})

    for m in gossip.get("members") or []:
        if isinstance(m, dict) and isinstance(m.get("id"), str):
            add(m["id"], str(m.get("state", "?")), str(m.get("region") or ""), str(m.get("address") or ""))
    if me and me not in seen:
        add(me, "alive", str(report.get("region") or ""), str(report.get("advertise") or report.get("listen") or ""))
    for peer in sorted((set(place) | spares | voters | ({coordinator} if coordinator else set())) - seen):
        add(peer, "unknown", "", "")
    return rows


def format_members(rows: list[dict[str, Any]], report: dict[str, Any] | None = None) -> str:
    """The rows as a table, the run and the counts by state above it."""
    training = (report or {}).get("training")
    training = training if isinstance(training, dict) else {}
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    head = f"{len(rows)} members: " + ", ".join(f"{n} {state}" for state, n in counts.items())
    run = training.get("run_id")
    if isinstance(run, str):
        over = training.get("state") in ("finished", "stopped", "paused")  # (else: this peer's own state)
        head += (f"; run {run[:8]}" + (f" ({training['state']})" if over else "")
                 + f" epoch {training.get('epoch', '?')}, "
                 f"{plural(training.get('stages', '?'), 'stage')} x {plural(training.get('dp', '?'), 'pipeline')}")
    lines = [head]
    gossip = (report or {}).get("gossip")
    if isinstance(gossip, dict) and "members" in (gossip.get("truncated") or []):
        total = (gossip.get("counts") or {}).get("total", "?")
        lines.append(f"(the daemon listed the first {len(gossip.get('members') or [])} of {total} members)")
    table = [[r["short_id"] + (" *" if r["me"] else ""), ",".join(r["roles"]) or "-",
              "-" if r["stage"] is None else str(r["stage"]), "-" if r["pipeline"] is None else str(r["pipeline"]),
              r["region"] or "-", r["address"] or "-", r["state"]] for r in rows]
    header = ["PEER", "ROLE", "STAGE", "PIPELINE", "REGION", "ADDRESS", "STATE"]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *table]]
    lines.append("(* this daemon; roles as this daemon knows them: its coordinator and the allocation it applied)")
    if report is not None and not isinstance(run, str):
        lines.append("(this daemon has applied no allocation, so it knows no stages or spares: "
                     "`dtfm-peer members` on a peer of the run shows them)")
    return "\n".join(lines)
