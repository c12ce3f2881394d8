"""Two DP replicas of one small stage (2 x 1) run through their stage runners on an in-memory
network, for the stage runner's tests (tests/control/epoch): the plan, the states, the runners,
how each run ended and every step report, and further steps of any set of replica states on a
fresh network (a new epoch's comm)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trio

from dtfm.control.epoch.runner import RunEnd, StageRunner, StepReport
from dtfm.train import PRESETS, TEST_CONFIG, CompressionConfig, Corpus, InMemoryHub, Plan, StageState, run_step

SPEC = dataclasses.replace(PRESETS["tiny"], n_layer=2)
CFG = dataclasses.replace(TEST_CONFIG, global_batch_seqs=2, micro_batches=1)
CORPUS = Corpus(np.frombuffer(b"a small corpus for one stage " * 64, dtype=np.uint8).copy(), "corpus")
PEERS = (b"p0", b"p1")


@dataclass
class Replicas:
    plan: Plan
    states: dict[bytes, StageState]
    runners: dict[bytes, StageRunner]
    ends: dict[bytes, RunEnd]
    seen: dict[bytes, list[StepReport]]  # each replica's step reports, in order


def run_replicas(tmp_path: Path, compression: CompressionConfig, *, end_step: int = 4,
                 checkpoint_every: int = 4) -> Replicas:
    """Both replicas of epoch 1 run to `end_step` with `compression`, each checkpointing under
    tmp_path/<peer id in hex>."""
    plan = Plan(tuple((p,) for p in PEERS), ((0, SPEC.n_layer),), epoch=1)
    hub = InMemoryHub()
    states = {p: StageState(SPEC, CFG, (0, SPEC.n_layer), compression=compression) for p in PEERS}
    seen: dict[bytes, list[StepReport]] = {p: [] for p in PEERS}
    runners = {p: StageRunner(states[p], plan, p, hub.endpoint(p), CORPUS, end_step=end_step,
                              checkpoint_every=checkpoint_every, checkpoint_dir=tmp_path / p.hex(),
                              on_step=seen[p].append) for p in PEERS}
    ends: dict[bytes, RunEnd] = {}

    async def run_all() -> None:
        async def one(p: bytes) -> None:
            ends[p] = await runners[p].run()
        async with trio.open_nursery() as n:
            for p in PEERS:
                n.start_soon(one, p)
    trio.run(run_all)
    return Replicas(plan, states, runners, ends, seen)


def steps(states: dict[bytes, StageState], plan: Plan, count: int) -> None:
    """`count` steps of every replica in `states` on a fresh in-memory network."""
    hub = InMemoryHub()
    with ThreadPoolExecutor(len(states)) as pool:
        for _ in range(count):
            for f in [pool.submit(run_step, states[p], plan, p, hub.endpoint(p), CORPUS) for p in PEERS]:
                f.result(timeout=60)
