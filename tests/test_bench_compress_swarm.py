"""bench/compress_swarm.py's pure helpers: the iteration time of a run with synchronising steps,
the prediction error, the allocation's matrix."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
_spec = importlib.util.spec_from_file_location("bench_compress_swarm", BENCH / "compress_swarm.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.path.insert(0, str(BENCH))  # as `python bench/compress_swarm.py` has it: its `common` beside it
try:
    _spec.loader.exec_module(bench)
finally:
    sys.path.remove(str(BENCH))


def rows(times: list[float]) -> list[dict]:
    return [{"step": k, "iteration_s": t} for k, t in enumerate(times)]


def test_period_one_is_the_median_after_skip():
    out = bench.cycle_iteration_s(rows([9.0, 9.0, 1.0, 3.0, 2.0]), 1, 2)
    assert out["iteration_s"] == 2.0
    assert (out["sync_steps"], out["local_steps"]) == (3, 0)


def test_diloco_cycle_weights_the_synchronising_steps():
    # H = 4: steps 3 and 7 synchronise (5 s), the others take 1 s; step 0 is skipped
    times = [50.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 5.0]
    out = bench.cycle_iteration_s(rows(times), 4, 1)
    assert out["local_median_s"] == 1.0 and out["sync_median_s"] == 5.0
    assert out["iteration_s"] == pytest.approx((3 * 1.0 + 5.0) / 4)
    assert out["median_s"] == 1.0  # the plain median would not see the synchronisations
    assert (out["sync_steps"], out["local_steps"]) == (2, 5)


def test_no_synchronising_step_kept_gives_no_figure():
    out = bench.cycle_iteration_s(rows([1.0] * 10), 16, 2)
    assert out["iteration_s"] is None and out["sync_median_s"] is None


def test_lines_without_a_time_are_left_out():
    r = rows([1.0, 2.0, 3.0]) + [{"step": 3, "iteration_s": None}]
    assert bench.cycle_iteration_s(r, 1, 0)["iteration_s"] == 2.0


def test_relative_error():
    assert bench.relative_error(1.2, 1.0) == pytest.approx(0.2)
    assert bench.relative_error(0.8, 1.0) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        bench.relative_error(1.0, 0.0)


def test_allocation_matrix_maps_pipelines_to_view_rows():
    X = bench.allocation_matrix([["c", "a"], ["b", "d"]], ["a", "b", "c", "d"])
    assert X.tolist() == [[2, 1], [0, 3]]  # (S, D): stage 0 is c and b
    assert X.dtype == np.int64
    with pytest.raises(ValueError, match="not in the view"):
        bench.allocation_matrix([["e"]], ["a"])
