"""The swarm heals itself: 8 real daemons on the emulated worldwide scenario train `tiny`
2 x 4 while peers are killed, restarted and partitioned away (bounded in time).

The oracle is single-process training: every step in the merged `train.jsonl` is there once,
in order, with the loss of the reference within 1e-5 (relative), whatever reconfigurations
happened, and
at the end every stage's replicas hold identical weights.
"""

import json
import time
from pathlib import Path

import pytest
from polling import wait_for
from swarms import ReferenceLosses, check_log, coordinator, placed, swarm_up, trainings, wait_steps

from dtfm.swarm import cli as swarm
from dtfm.swarm.proc import peer_request, peer_status
from dtfm.swarm.state import load_state

N_PEERS = 8
STEPS = 400  # more than the test runs: it stops the run itself


@pytest.fixture(scope="module")
def run_dir():
    with swarm_up("dtfm-heal-", peers=N_PEERS) as d:
        yield d


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_swarm_survives_deaths_restarts_and_a_partition(run_dir):
    reference = ReferenceLosses()
    assert swarm.main(["train", "--run-dir", str(run_dir), "--stages", "2", "--dp", "4",
                       "--steps", str(STEPS)]) == 0
    wait_steps(run_dir, 3)
    state = load_state(run_dir)

    # 1. SIGKILL the coordinator: a new one is elected in a higher term and the run goes on.
    name, before = wait_for("a coordinator", lambda: coordinator(state), 30, interval_s=0.5)
    killed_at = time.monotonic()
    assert swarm.main(["kill", name, "--run-dir", str(run_dir)]) == 0
    wait_steps(run_dir, 3)
    recovered_s = time.monotonic() - killed_at
    new_name, after = wait_for("a new coordinator", lambda: coordinator(state), 30, interval_s=0.5)
    assert new_name != name and after["term"] > before["term"]
    assert after["last_reconfig"]["resume_step"] >= 3
    check_log(run_dir, reference)
    print(f"coordinator killed: training again after {recovered_s:.1f} s")

    # 2. Restart it with its data dir: it rejoins, is placed again and recovers its stage from
    # the peers that hold it (its own copy is stale).
    assert swarm.main(["restart", name, "--run-dir", str(run_dir)]) == 0
    state = load_state(run_dir)
    peer = next(p for p in state.peers if p.name == name)

    def placed_again():
        t = (peer_status(peer) or {}).get("training") or {}
        return t.get("state") == "training" and t.get("fetched_bytes", 0) > 0 and t
    t = wait_for(f"{name} to train a fetched stage again", placed_again, 240, interval_s=1.0)
    assert t["epoch"] > before["epoch"]
    wait_steps(run_dir, 2)
    check_log(run_dir, reference)

    # 3. Kill two peers of one stage's DP group at once: the stage survives in the others.
    t = trainings(state)
    by_stage: dict[int, list[str]] = {}
    for n, v in sorted(t.items()):
        if v.get("stage") is not None and v.get("state") == "training":
            by_stage.setdefault(v["stage"], []).append(n)
    _, holders = max(by_stage.items(), key=lambda kv: len(kv[1]))
    assert len(holders) >= 3, {n: (v.get("stage"), v.get("state"), v.get("role")) for n, v in t.items()}
    victims = [n for n in holders if t[n].get("role") != "coordinator"][:2]
    for victim in victims:
        assert swarm.main(["kill", victim, "--run-dir", str(run_dir)]) == 0
    wait_steps(run_dir, 3)
    check_log(run_dir, reference)

    # 4. Both come back; then a partition cuts 3 peers, the coordinator among them, from the other
    # 5: the minority elects nobody and stops training, the majority elects a coordinator and
    # trains on; after the heal the swarm trains on as one.
    for victim in victims:
        assert swarm.main(["restart", victim, "--run-dir", str(run_dir)]) == 0
    state = load_state(run_dir)
    wait_for("every peer placed in one epoch", lambda: placed(state), 240, interval_s=1.0)
    wait_steps(run_dir, 1)
    c_name, c = coordinator(state)
    minority = [c_name] + sorted(n for n in trainings(state) if n != c_name)[:2]
    majority = sorted(p.name for p in state.peers if p.name not in minority)
    for a in minority:
        for b in majority:
            assert swarm.main(["partition", a, b, "--run-dir", str(run_dir)]) == 0
    minority_peers = [p for p in state.peers if p.name in minority]

    def majority_elects():
        got = coordinator(state)
        return got is not None and got[0] in majority and got[1]["term"] > c["term"] and got
    wait_for("the majority to elect a coordinator", majority_elects, 120, interval_s=1.0)

    def minority_idle():
        t = {p.name: (peer_status(p) or {}).get("training") or {} for p in minority_peers}
        return all(v.get("role") != "coordinator" and v.get("state") != "training" for v in t.values()) and t
    wait_for("the minority to stop training", minority_idle, 150, interval_s=1.0)
    # (the majority trains on when it holds every stage; either way nothing is re-initialised)
    assert swarm.main(["heal", "--run-dir", str(run_dir)]) == 0
    wait_for("every peer placed in one epoch after the heal", lambda: placed(state), 240, interval_s=1.0)
    wait_steps(run_dir, 2)

    # The run ends on one step everywhere (at once: the reference's float32 noise has more
    # chances to reach 1e-5 the longer the run); every stage's replicas hold identical weights.
    c_name, _ = coordinator(state)
    c_peer = next(p for p in state.peers if p.name == c_name)
    peer_request(c_peer, "train_stop", {}, timeout_s=30)

    def all_ended():
        t = {n: v for n, v in trainings(state).items() if v.get("stage") is not None}
        return t and all("last_end" in v and v.get("state") != "training" for v in t.values()) and t
    ended = wait_for("every peer to end", all_ended, 120, interval_s=0.5)
    groups: dict[int, set[str]] = {}
    for v in ended.values():
        groups.setdefault(v["stage"], set()).add(v["last_end"]["params_sha256"])
    assert all(len(h) == 1 for h in groups.values()), groups
    swarm.main(["wait", "--run-dir", str(run_dir), "--step", "0", "--timeout", "10"])
    rows = check_log(run_dir, reference)
    events = [e["event"] for e in _events(run_dir)]
    assert events.count("reconfigure") >= 3, events
    assert len(rows) >= 11


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
