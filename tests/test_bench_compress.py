"""bench/compress.py's judging: the points a run is evaluated at (synchronised steps only), the
mean and spread over seeds and the gaps to exact, on synthetic runs; the held-out split."""

import statistics

import pytest
from bench_modules import load_bench

from dtfm.train.compress import CompressionConfig, get_compression

bench = load_bench("compress")

EXACT_B = {"pp_fwd": 1000.0, "pp_bwd": 1000.0, "dp": 20000.0, "other": 0.0}
CODED_B = {"pp_fwd": 1000.0, "pp_bwd": 1000.0, "dp": 200.0, "other": 0.0}


def run(name, seed, held, train_tail, b, last=2):
    losses = [9.0] * 5 + [train_tail] * last  # only the last `last` steps count
    return {"name": name, "config": name, "seed": seed, "first_step": 0, "losses": losses, "wall_s": 1.0,
            "evals": [{"step": 16, "heldout_loss": held, "replicas_identical": True}], "heldout_loss": held,
            "bytes_per_step": dict(b)}


def test_summary_mean_spread_and_gaps_over_seeds():
    runs = [run("exact", 0, 2.0, 2.2, EXACT_B), run("exact", 1, 2.1, 2.3, EXACT_B), run("exact", 2, 2.2, 2.4, EXACT_B),
            run("diloco", 0, 2.04, 2.2, CODED_B), run("diloco", 1, 2.1, 2.3, CODED_B),
            run("diloco", 2, 2.31, 2.52, CODED_B)]
    rows = {r["name"]: r for r in bench.summarise(runs, last=2)}
    ex, dl = rows["exact"], rows["diloco"]
    assert ex["heldout"]["mean"] == pytest.approx(2.1) and ex["heldout_gap"] == 0
    assert dl["heldout"]["mean"] == pytest.approx(statistics.fmean([2.04, 2.1, 2.31]), abs=1e-5)
    assert (dl["heldout"]["min"], dl["heldout"]["max"]) == (2.04, 2.31)
    assert dl["heldout"]["stdev"] == pytest.approx(statistics.stdev([2.04, 2.1, 2.31]), abs=1e-5)
    assert dl["heldout"]["n"] == 3
    assert dl["heldout_gap"] == pytest.approx(statistics.fmean([2.04, 2.1, 2.31]) / 2.1 - 1, abs=1e-5)
    assert dl["loss_gap"] == dl["heldout_gap"]
    paired = dl["heldout_gap_paired"]  # each seed against exact of the same seed
    assert paired["min"] == pytest.approx(0.0) and paired["max"] == pytest.approx(2.31 / 2.2 - 1, abs=1e-5)
    assert paired["mean"] == pytest.approx(statistics.fmean([0.02, 0.0, 2.31 / 2.2 - 1]), abs=1e-5)
    assert dl["train_last"]["mean"] == pytest.approx(statistics.fmean([2.2, 2.3, 2.52]), abs=1e-5)
    assert dl["train_gap"] == pytest.approx(statistics.fmean([2.2, 2.3, 2.52]) / 2.3 - 1, abs=1e-5)
    assert dl["dp_bytes_ratio"] == 100.0 and dl["pp_bytes_ratio"] == 1.0
    assert dl["total_bytes_ratio"] == pytest.approx(22000 / 2200, abs=0.01)
    assert dl["seeds"] == [0, 1, 2] and dl["replicas_identical"]


def test_one_seed_has_no_spread():
    rows = bench.summarise([run("exact", 0, 2.0, 2.2, EXACT_B), run("pp", 0, 2.02, 2.2, EXACT_B)], last=2)
    pp = rows[1]
    assert pp["heldout"]["stdev"] == 0.0 and pp["heldout"]["min"] == pp["heldout"]["max"] == 2.02
    assert pp["heldout_gap"] == pytest.approx(0.01)


def test_spread_is_sample_stdev():
    got = bench.spread([1.0, 2.0, 4.0])
    assert got == {"mean": pytest.approx(7 / 3), "min": 1.0, "max": 4.0, "stdev": pytest.approx(1.5275252, abs=1e-6),
                   "n": 3}


def test_eval_points_are_synchronised_steps():
    ramp = get_compression("diloco")  # 8 syncs at 1, 2, 4, 8: the first 120 steps, then every 16
    points = bench.eval_points(ramp, 600, 0, 4, 16)
    assert points == [552, 568, 584, 600]
    assert all(ramp.sync_due(n - 1) for n in points)  # the step just run synchronised
    assert bench.eval_points(CompressionConfig(), 600, 0, 4, 16) == [552, 568, 584, 600]
    # a fine-tune from step 1000: counted from there
    assert bench.eval_points(CompressionConfig(), 100, 1000, 2, 16) == [1084, 1100]
    assert bench.eval_points(ramp, 100, 1000, 2, 16) == [1080, 1096]  # 1000 - 120 = 55 x 16: in step with H


def test_heldout_windows_are_fixed_and_in_the_held_out_text():
    import numpy as np

    tokens = np.arange(1000, dtype=np.uint8) % 251
    x, y = bench.heldout_windows(tokens, 5, 16)
    assert x.shape == y.shape == (5, 16)
    assert int(x[0, 0]) == 0 and bool((y[:, :-1] == x[:, 1:]).all())
    x2, _ = bench.heldout_windows(tokens, 5, 16)
    assert bool((x == x2).all())
