"""32 real daemons on one machine (emulated worldwide): every peer up and measured, `tiny`
trained over all of them (4 stages x 8 pipelines: left to the scheduler, a model this small
goes on a few peers and the rest are spares) equal to single-process training step by step,
and an eighth of the peers SIGKILLed at once without a step lost. A soak: it takes
minutes on a 2-core machine (`pytest -m soak tests/swarm/test_swarm_scale.py`); the default run
covers the same rules at 64 nodes in simulation (tests/control/plane/test_plane_scale.py)."""

import json
import os
import signal

import pytest
from swarms import ReferenceLosses, check_log, swarm_up, trainings, wait_steps

from dtfm.swarm import cli as swarm
from dtfm.swarm.state import load_state
from dtfm.train import TrainConfig

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]

PEERS = 32
BATCH = 32


def test_32_daemons_train_as_one_process_and_lose_no_step_when_an_eighth_is_killed():
    reference = ReferenceLosses(cfg=TrainConfig(seed=0, global_batch_seqs=BATCH, micro_batches=1))
    with swarm_up("dtfm-scale-", peers=PEERS, timeout_s=900) as d:
        assert swarm.main(["train", "--run-dir", str(d), "--steps", "100000", "--batch", str(BATCH),
                           "--micro-batches", "1", "--stages", "4", "--dp", str(PEERS // 4),
                           "--start-timeout", "900"]) == 0
        wait_steps(d, 4, timeout_s=900)
        state = load_state(d)
        t = trainings(state)
        assert sum(1 for v in t.values() if v.get("stage") is not None) == PEERS, t
        victims = [p for p in state.peers if t[p.name].get("role") != "coordinator"][: PEERS // 8]
        for p in victims:
            os.kill(p.pid, signal.SIGKILL)
        wait_steps(d, 6, timeout_s=900)
        check_log(d, reference)
        events = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines() if x.strip()]
        assert not [e for e in events if e.get("event") == "rollback"]
