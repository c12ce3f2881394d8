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
from typing import Any

from dtfm.net import pack

CORE_KEYS = frozenset({"peer_id", "short_id", "listen", "advertise", "region", "pid", "data_dir",
                       "uptime_s", "peers", "departed", "refused", "truncated"})

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


def format_text(report: dict[str, Any]) -> str:
    """Human-readable status, as `dtfm-peer status` prints it."""
    lines = [
        f"peer      {report.get('short_id', '?')}  ({report.get('peer_id', '?')})",
        f"listen    {report.get('listen', '?')}",
        f"advertise {report.get('advertise') or '- (waiting for a peer to confirm an address)'}",
        f"region    {report.get('region') or '-'}",
        f"uptime    {format_duration(float(report.get('uptime_s', 0)))}",
        f"data dir  {report.get('data_dir', '?')}",
    ]
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
    for key in sorted(k for k in report if k not in CORE_KEYS):
        value = report[key]
        text = value if isinstance(value, str) else json.dumps(value, default=_json_default,
                                                                 sort_keys=True)
        lines.append(f"{key:<9} {text}")
    return "\n".join(lines)


def _json_default(obj: object) -> object:
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).hex()
    return str(obj)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, default=_json_default, indent=2, sort_keys=True)
