"""A failed multi-process swarm test reports what the swarm did: its merged events and the
control plane's lines of every daemon's log (the run dir itself is removed afterwards)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# the control plane's decisions: hand-outs, reconfigurations, pauses, lost reports, elections
_KEY_LINES = re.compile(r"issuing|reconfigur|run states|paus|report|back-fill|elected|stepped|stops|stopped|"
                        r"left out|refus|abort|ERROR|WARNING")
MAX_LINES_PER_PEER = 60
TAIL_LINES = 12


def swarm_digest(run_dir: Path) -> str:
    out = []
    events = run_dir / "events.jsonl"
    try:  # each daemon's process: running, or gone (its pid, as `dtfm-swarm up` kept it)
        from dtfm.swarm.state import load_state
        out += ["== processes", *(f"{p.name} pid {p.pid}: {'running' if p.alive() else 'gone'}"
                                  for p in load_state(run_dir).peers)]
    except Exception as e:  # (a digest never hides the failure it reports)
        out += [f"== processes: unknown ({e})"]
    if events.exists():
        out += ["== events.jsonl (merged)", events.read_text()[-20_000:]]
    for log in sorted(run_dir.glob("p*/daemon.log")):
        try:
            lines = [x for x in log.read_text(errors="replace").splitlines() if _KEY_LINES.search(x)]
        except OSError:
            continue
        out += [f"== {log.parent.name}/daemon.log ({len(lines)} key lines, the last {MAX_LINES_PER_PEER})",
                *(x[:400] for x in lines[-MAX_LINES_PER_PEER:])]
        tail = [x for x in log.read_text(errors="replace").splitlines()[-TAIL_LINES:] if x not in lines]
        if tail:  # (what it did last: a peer that went quiet, or died without a word)
            out += [f"== {log.parent.name}/daemon.log (its last lines, the key lines above left out)",
                    *(x[:400] for x in tail)]
        printed = log.with_name("daemon.out")  # (a crash's traceback)
        text = printed.read_text(errors="replace").strip() if printed.exists() else ""
        if text:
            out += [f"== {log.parent.name}/daemon.out (the end)", text[-4000:]]
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    run_dir = getattr(item, "funcargs", {}).get("run_dir")
    if rep.failed and call.when == "call" and isinstance(run_dir, Path) and run_dir.is_dir():
        rep.sections.append(("swarm digest", swarm_digest(run_dir)))



# The longest modules, longest first (their real swarms wait on clocks more than they compute):
# started first, each on a worker of its own, while the unit tests fill the other worker.
LONGEST_FIRST = ("test_swarm_heal", "test_swarm_train", "test_swarm_multiprocess", "test_swarm_hijack", "test_daemon_multiprocess",
                 "test_netns", "test_gossip_figures")


def pytest_collection_modifyitems(session, config, items):
    """The longest modules first, then the other modules with real multi-process swarms
    (`slow`), then the rest, each module kept whole: with the suite spread over workers
    (`-n 2 --dist loadscope`, pyproject.toml) the long waits start at once."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow") and item.module}

    def rank(item) -> int:
        name = item.module.__name__ if item.module else ""
        if name in LONGEST_FIRST:
            return LONGEST_FIRST.index(name)
        return len(LONGEST_FIRST) + (0 if name in slow_modules else 1)
    items.sort(key=rank)
