"""A stage that no live peer holds comes back from checkpoints: 5 real daemons (emulated
datacenter) train `tiny` 2 x 2 with a checkpoint every 3 steps; both holders of one stage are
SIGKILLed at once. The run pauses (never goes on with re-initialised weights); when the two are
restarted with their data dirs, the swarm restores the stage from their checkpoints and rolls
back to the newest step every stage is saved or held at (bounded in time).

The oracle is single-process training: the merged `train.jsonl` has every step once, in order,
with the reference's loss (the re-run steps included). An earlier run in the same data dirs,
with another seed and checkpoints at later steps, must not be taken for this run's.
"""

import pytest
from polling import wait_for
from swarms import ReferenceLosses, check_log, coordinator, placed, swarm_up, trainings, wait_steps

from dtfm.swarm import cli as swarm
from dtfm.swarm.proc import peer_request
from dtfm.swarm.state import load_state
from dtfm.swarm.train import sync_logs

N_PEERS = 5
EVERY = 3


@pytest.fixture(scope="module")
def run_dir():
    with swarm_up("dtfm-rb-", scenario="datacenter", peers=N_PEERS) as d:
        yield d


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stage_no_live_peer_holds_is_restored_from_checkpoints(run_dir):
    # An earlier run (seed 1) leaves checkpoints of the same layout at steps 12, 16 and 20.
    assert swarm.main(["train", "--run-dir", str(run_dir), "--stages", "2", "--dp", "2", "--steps", "21",
                       "--seed", "1", "--checkpoint-every", "4"]) == 0
    wait_steps(run_dir, 21)
    state = load_state(run_dir)
    wait_for("the first run to end", lambda: all(v.get("state") != "training" for v in trainings(state).values()),
             60, interval_s=0.5)

    reference = ReferenceLosses()
    assert swarm.main(["train", "--run-dir", str(run_dir), "--stages", "2", "--dp", "2", "--steps", "400",
                       "--checkpoint-every", str(EVERY)]) == 0
    assert swarm.main(["wait", "--run-dir", str(run_dir), "--step", "8", "--timeout", "240"]) == 0
    check_log(run_dir, reference)
    c_name, _ = wait_for("a coordinator", lambda: coordinator(state), 30, interval_s=0.5)
    t = trainings(state)
    by_stage: dict[int, list[str]] = {}
    for n, v in sorted(t.items()):
        if v.get("stage") is not None and v.get("state") == "training":
            by_stage.setdefault(v["stage"], []).append(n)
    victims = next(h for _, h in sorted(by_stage.items()) if c_name not in h)
    assert len(victims) == 2, by_stage
    for victim in victims:
        assert swarm.main(["kill", victim, "--run-dir", str(run_dir)]) == 0

    # No reachable peer holds the stage (its checkpoints are on the dead peers): the run pauses.
    def paused():
        return any(e["event"] == "paused" for e in sync_logs(run_dir, state)[1])
    wait_for("the run to pause", paused, 120, interval_s=1.0)
    last_before = sync_logs(run_dir, state)[0][-1]["step"]  # the last step before the kill

    for victim in victims:
        assert swarm.main(["restart", victim, "--run-dir", str(run_dir)]) == 0
    state = load_state(run_dir)
    wait_for("every peer placed in one epoch", lambda: placed(state), 240, interval_s=1.0)
    wait_steps(run_dir, 2)
    c_name, _ = wait_for("a coordinator", lambda: coordinator(state), 30, interval_s=0.5)
    peer_request(next(p for p in state.peers if p.name == c_name), "train_stop", {}, timeout_s=30)
    wait_for("every peer to end", lambda: all(v.get("state") != "training" for v in trainings(state).values()),
             120, interval_s=0.5)
    swarm.main(["wait", "--run-dir", str(run_dir), "--step", "0", "--timeout", "10"])
    rows = check_log(run_dir, reference)
    events = sync_logs(run_dir, state)[1]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks, [e["event"] for e in events]
    resume = rollbacks[-1]["resume_step"]
    # the newest checkpoint of this run at or before the last step logged: not the earlier run's
    assert resume % EVERY == 0 and 0 < resume <= last_before + 1, (resume, last_before)
    assert rows[-1]["step"] > last_before
