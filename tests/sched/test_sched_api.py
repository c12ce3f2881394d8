"""The public surface the swarm coordinator uses: a measured (asymmetric, unlabelled) view."""

import subprocess
import sys

import numpy as np

import dtfm.sched as sched


def test_public_names_resolve_and_nothing_heavy_is_imported():
    for name in sched.__all__:
        assert getattr(sched, name) is not None
    code = "import sys, dtfm.sched, dtfm.sched.cli; print(sorted({'torch', 'trio'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_solve_on_a_measured_asymmetric_view():
    rng = np.random.default_rng(11)
    n = 14
    site = np.repeat(np.arange(3), [5, 5, 4])
    delay = np.where(site[:, None] == site[None, :], 2.0, 60.0) * rng.uniform(0.8, 1.3, (n, n))
    bw = np.where(site[:, None] == site[None, :], 5.0, 0.5) * rng.uniform(0.8, 1.3, (n, n))
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bw, np.inf)
    alloc = sched.solve(delay, bw, sched.PAPER_GPT3_XL, stages=4, dp=3, config=sched.SEARCH_PROFILES["test"])
    assert len(alloc.spares) == 2
    assert sorted([p for pipe in alloc.pipelines for p in pipe] + list(alloc.spares)) == list(range(n))
    assert sched.evaluate(delay, bw, sched.PAPER_GPT3_XL, alloc.pipelines) == alloc.cost
    model = sched.cost_model(delay, bw, sched.PAPER_GPT3_XL, 4, 3)
    sim = sched.simulate_iteration(model, alloc.matrix)
    assert sim.iteration_s >= max(sim.allreduce_s) > 0
    assert sim.iteration_s >= sim.pipeline_s > 0
