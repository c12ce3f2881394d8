"""A scripted multi-region swarm of real daemons on loopback (bounded in time).

The emulated worldwide links must be measured back within 20% (delay) and 30% (bandwidth) for
every pair; a SIGKILLed peer is declared dead by every other peer, and comes back alive under
the same id when restarted with its data dir.
"""


import numpy as np
import pytest
from polling import wait_for
from swarms import scratch_run_dir

from dtfm.scenarios import load_scenario
from dtfm.swarm import cli as swarm
from dtfm.swarm.proc import peer_status
from dtfm.swarm.report import status_report
from dtfm.swarm.state import load_state

N_PEERS = 6


def member_states(state, peer_id: str) -> list[str | None]:
    """How every other running peer sees peer_id (None: not answering or not a member)."""
    out = []
    for p in state.peers:
        if p.peer_id == peer_id or not p.alive():
            continue
        rep = peer_status(p)
        members = {m["id"]: m["state"] for m in ((rep or {}).get("gossip") or {}).get("members", [])}
        out.append(members.get(peer_id))
    return out


@pytest.fixture
def run_dir():
    with scratch_run_dir("dtfm-sw-") as d:
        yield d


@pytest.mark.slow
@pytest.mark.soak  # 80 s: the link measurement accuracy it checks wants an idle machine
@pytest.mark.timeout(400)
def test_worldwide_swarm_measures_links_detects_kill_and_restart(run_dir):
    rc = swarm.main(["up", "--run-dir", str(run_dir), "--scenario", "worldwide",
                     "--peers", str(N_PEERS), "--timeout", "240"])
    assert rc == 0
    state = load_state(run_dir)
    # the machine's compute measured once, kept in the run dir, every peer's starting figure
    assert state.compute_ms > 0 and (run_dir / "speed.json").exists()
    report = status_report(state)
    assert [p["state"] for p in report["peers"]] == ["running"] * N_PEERS
    measured = report["measured"]
    assert measured["complete"]
    expected = load_scenario("worldwide").scaled(N_PEERS)
    assert [p["region"] for p in report["peers"]] == expected.peer_regions()
    delay = np.array(measured["delay_ms"], dtype=float)
    bw = np.array(measured["bandwidth_gbps"], dtype=float)
    want_delay, want_bw = expected.delay_ms(), expected.bandwidth_gbps()
    off = ~np.eye(N_PEERS, dtype=bool)
    delay_err = np.abs(delay[off] - want_delay[off]) / want_delay[off]
    bw_err = np.abs(bw[off] - want_bw[off]) / want_bw[off]
    assert delay_err.max() <= 0.20, f"delay off by up to {delay_err.max():.0%}"
    assert bw_err.max() <= 0.30, f"bandwidth off by up to {bw_err.max():.0%}"

    victim = state.peers[-1]
    victim_id = victim.peer_id
    assert swarm.main(["kill", victim.name, "--run-dir", str(run_dir)]) == 0
    wait_for("every peer to declare the killed peer dead",
             lambda: all(s == "dead" for s in member_states(state, victim_id)), 150, interval_s=0.5)

    assert swarm.main(["restart", victim.name, "--run-dir", str(run_dir)]) == 0
    state = load_state(run_dir)

    def back_alive():
        rep = peer_status(state.find(victim.name))
        return (rep is not None and rep["peer_id"] == victim_id
                and all(s == "alive" for s in member_states(state, victim_id)))

    wait_for("the restarted peer to be alive again under the same id", back_alive, 90, interval_s=0.5)
