"""Scripted swarms for the multi-process tests: a run dir that is torn down whatever happens, the
single-process reference they are compared with, and what the tests ask of a swarm."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from dtfm.swarm import cli as swarm
from dtfm.swarm.proc import peer_status
from dtfm.swarm.train import read_log
from dtfm.train import TrainConfig, get_preset, load_corpus, reference_state, reference_step


@contextmanager
def scratch_run_dir(prefix: str):
    """A fresh run dir (short: the control sockets live inside it); every peer started in it is
    killed and the dir removed on the way out (kept, for reading its logs, with
    DTFM_KEEP_RUN_DIRS=1)."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield d
    finally:
        try:
            swarm.main(["down", "--run-dir", str(d), "--kill"])
        finally:
            if not os.environ.get("DTFM_KEEP_RUN_DIRS"):
                shutil.rmtree(d, ignore_errors=True)


@contextmanager
def swarm_up(prefix: str, *, scenario: str = "worldwide", peers: int = 8, timeout_s: int = 240,
             extra: tuple[str, ...] = ()):
    """`dtfm-swarm up` in a scratch run dir (`extra`: more `up` arguments)."""
    with scratch_run_dir(prefix) as d:
        # (every peer starts at one compute figure and probes no layer: the tests' runs fix
        # their shapes, and a probe costs each start seconds of a shared machine; the
        # multiprocess test measures the machine)
        assert swarm.main(["up", "--run-dir", str(d), "--scenario", scenario, "--peers", str(peers),
                           "--timeout", str(timeout_s), "--compute-ms", "30", "--layer-probe", "off",
                           *extra]) == 0
        yield d


class ReferenceLosses:
    """The single-process reference's loss per step, computed as far as it is asked for (a swarm
    that trains on while a test waits may log more steps than were foreseen). The losses of one
    training config are computed once per test process, whichever test asks."""

    _computed: dict[str, tuple[object, object, list[float]]] = {}

    def __init__(self, seed: int = 0, cfg: TrainConfig | None = None):
        # (what `train start` uses: the defaults of `python -m dtfm.train`, or the run's knobs)
        cfg = cfg or TrainConfig(seed=seed)
        key = repr(cfg)
        if key not in self._computed:
            self._computed[key] = (reference_state(get_preset("tiny"), cfg), load_corpus(), [])
        self._state, self._corpus, self._losses = self._computed[key]

    def __getitem__(self, step: int) -> float:
        if step < 0:
            raise IndexError(step)
        while len(self._losses) <= step:
            self._losses.append(reference_step(self._state, self._corpus))
        return self._losses[step]


def reference_losses(steps: int, seed: int = 0) -> list[float]:
    ref = ReferenceLosses(seed)
    return [ref[i] for i in range(steps)]


def trainings(state) -> dict[str, dict]:
    """Each live peer's `training` status."""
    return {p.name: ((peer_status(p) or {}).get("training") or {}) for p in state.peers if p.alive()}


def ended_this_epoch(t: dict) -> bool:
    """A peer's `training` status says its runner of the current epoch ended: `last_end` is
    that epoch's (an earlier epoch's stays until then) and it is not still going to a stop."""
    end = t.get("last_end")
    return end is not None and end.get("epoch") == t.get("epoch") and t.get("state") not in ("training", "stopping")


def run_ended(state) -> dict[str, dict] | None:
    """Every stage holder of the newest epoch says its runner of that epoch ended: those
    holders' `training` status, or None while one still trains. (A peer left out of that epoch,
    say restarted while its links were measured again, still shows the stage it held before.)"""
    t = trainings(state)
    newest = max((v.get("epoch") or 0 for v in t.values()), default=0)
    holders = {n: v for n, v in t.items() if v.get("stage") is not None and v.get("epoch") == newest}
    return holders if holders and all(ended_this_epoch(v) for v in holders.values()) else None


def coordinator(state) -> tuple[str, dict] | None:
    for name, t in trainings(state).items():
        if t.get("role") == "coordinator":
            return name, t
    return None


def placed(state) -> dict | None:
    """Every live peer holds a stage or a spare place in one epoch, and the stages train."""
    t = trainings(state)
    epochs = {v.get("epoch") for v in t.values()}
    if len(t) != len(state.peers) or len(epochs) != 1 or None in epochs:
        return None
    ok = all(v.get("state") == "training" or v.get("state") == "spare" or v.get("role") == "spare"
             for v in t.values())
    return t if ok else None


def check_log(run_dir: Path, reference: ReferenceLosses) -> list[dict]:
    """Every step in the run dir's merged train.jsonl once, in order, with the reference's loss."""
    rows = read_log(run_dir / "train.jsonl")
    assert [r["step"] for r in rows] == list(range(len(rows))), "a step is missing or repeated"
    for r in rows:
        # 1e-5 of the loss: a new D changes the float32 summation order of the batch, and those
        # differences grow over the steps (to ~1.5e-5 absolute by step 25 at a loss near 3)
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=1e-5, abs=1e-5), r
    return rows


def wait_steps(run_dir: Path, more: int, timeout_s: float = 240) -> int:
    """Wait until `more` steps past the last logged one are logged; returns that step."""
    rows = read_log(run_dir / "train.jsonl") if (run_dir / "train.jsonl").exists() else []
    target = (rows[-1]["step"] if rows else -1) + more
    assert swarm.main(["wait", "--run-dir", str(run_dir), "--step", str(target + 1), "--timeout", str(timeout_s)]) == 0
    return target
