"""bench/compress_swarm.py's pure helpers: the iteration time of a run with synchronising steps,
the prediction error, the allocation's matrix."""


import numpy as np
import pytest
from bench_modules import load_bench

bench = load_bench("compress_swarm")


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
    assert out["mean_s"] == pytest.approx(sum(times[1:]) / 7)
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


# ---- the bandwidth scale -------------------------------------------------------------------------


def test_bandwidth_bound_share():
    assert bench.bandwidth_bound_share(4.0, 1.0) == pytest.approx(0.75)
    assert bench.bandwidth_bound_share(1.0, 1.0) == 0.0
    with pytest.raises(ValueError):
        bench.bandwidth_bound_share(0.0, 1.0)


def test_match_bandwidth_scale_inverts_a_falling_share():
    # a share of the form 1 - f / (f + c / s): bandwidth c / s, floor f
    def share(s: float) -> float:
        return 1 - 0.5 / (0.5 + 0.02 / s)
    s = bench.match_bandwidth_scale(share, 0.79)
    assert share(s) == pytest.approx(0.79, abs=1e-6)
    assert s == pytest.approx(0.02 * 0.21 / (0.79 * 0.5), rel=1e-5)
    with pytest.raises(ValueError, match="not reached"):
        bench.match_bandwidth_scale(share, 0.999999)  # beyond the share at the smallest scale


def test_tiny_on_the_worldwide_scenario_is_as_bandwidth_bound_as_gpt3_xl_near_0_011():
    share_at, info = bench.tiny_share_at(0.04, time_budget_s=5.0)
    scales = [0.003, 0.006, 0.011, 0.02, 0.04, 0.08]
    shares = [share_at(s) for s in scales]
    assert all(a > b for a, b in zip(shares, shares[1:]))  # more bandwidth, less bound
    xl = bench.gpt3_xl_bandwidth_share(time_budget_s=5.0)
    assert xl["bandwidth_bound_share"] == pytest.approx(0.790, abs=0.005)  # 1 - 5.869 / 27.973
    s = bench.match_bandwidth_scale(share_at, xl["bandwidth_bound_share"])
    assert share_at(s) == pytest.approx(xl["bandwidth_bound_share"], abs=1e-5)
    assert 0.009 < s < 0.013 and info["shape"] == "4x2"


# ---- time to loss ----------------------------------------------------------------------------------


def loss_rows(losses: list[float]) -> list[dict]:
    return [{"step": k, "loss": v, "iteration_s": 1.0} for k, v in enumerate(losses)]


def test_smoothed_losses_average_complete_trailing_windows():
    curve = bench.smoothed_losses(loss_rows([4.0, 2.0, 3.0, 1.0]), 2)
    assert curve == {1: 3.0, 2: 2.5, 3: 2.0}
    gap = loss_rows([4.0, 2.0, 3.0, 1.0])
    gap[1]["loss"] = None  # a step without a loss: the windows holding it are incomplete
    assert bench.smoothed_losses(gap, 2) == {3: 2.0}


def test_step_efficiency_of_a_method_that_learns_at_three_quarters_the_pace():
    exact = [10.0 - k for k in range(10)]  # exact loses 1 per step
    slow = [10.0 - 0.75 * k for k in range(14)]  # the method 0.75 per step
    out = bench.step_efficiency(loss_rows(exact), loss_rows(slow), 8, 1)
    assert out["target_loss"] == 3.0  # exact after 8 steps (step 7)
    assert out["steps"] == 11  # 10 - 0.75 k <= 3 at k = 10 (9.33 rounds up): 11 steps
    assert out["efficiency"] == pytest.approx(8 / 11)
    assert out["loss_at_target_step"] == 4.75  # the method after 8 steps
    assert out["exact_equivalent_steps"] == 7  # exact reaches 4.75 at step 6 (4.0)
    # with a window, both curves are smoothed alike: the same pace gives the same steps
    smooth = bench.step_efficiency(loss_rows(exact), loss_rows(slow), 8, 3)
    assert smooth["target_loss"] == pytest.approx(4.0)  # mean of 5, 4, 3
    assert smooth["steps"] == 10  # mean(10 - .75 (k-2..k)) = 10.75 - .75 k <= 4 at k = 9: 10 steps
    assert smooth["efficiency"] == pytest.approx(8 / 10)


def test_a_method_that_never_reaches_the_target_has_no_efficiency():
    out = bench.step_efficiency(loss_rows([5.0, 4.0, 3.0]), loss_rows([5.0, 4.5, 4.2, 4.1]), 3, 1)
    assert out["steps"] is None and out["efficiency"] is None
    assert out["exact_equivalent_steps"] == 2  # exact's 4.0 at step 1 is below the method's 4.2
    with pytest.raises(ValueError, match="no complete"):
        bench.step_efficiency(loss_rows([5.0, 4.0]), loss_rows([5.0]), 4, 1)


def test_spread_skips_missing_figures():
    sp = bench.spread([2.0, None, 4.0])
    assert sp == {"n": 2, "missing": 1, "mean": 3.0, "stdev": pytest.approx(2 ** 0.5), "min": 2.0, "max": 4.0}
    assert bench.spread([None])["mean"] is None
    assert bench.spread([1.5])["stdev"] == 0.0


def test_exact_in_the_methods_is_the_reference_not_a_second_run():
    assert bench.method_names("exact,slow-link,,auto") == ["slow-link", "auto"]
    assert bench.method_names("exact;slow-link;slow-link,dp_overlap_steps=1") == \
        ["slow-link", "slow-link,dp_overlap_steps=1"]


def run_figures(it: float, predicted: float, error: float, speedup: float, eff: float | None, ttt: float | None,
                tts: float | None, wall: float | None = None, wall_speedup: float | None = None) -> dict:
    return {"measured": {"iteration_s": it}, "predicted_s": predicted, "prediction_error": error,
            "speedup_measured": speedup, "loss": {"efficiency": eff, "exact_equivalent_efficiency": eff},
            "time_to_target_s": ttt, "time_to_target_speedup": tts, "wall_time_to_target_s": wall,
            "wall_time_to_target_speedup": wall_speedup}


def test_the_time_on_the_clock_sums_every_step_up_to_the_target():
    rows = [{"step": k, "iteration_s": 2.0 if k % 4 == 3 else 0.5} for k in range(12)]  # a sync every 4th step
    rows.append({"step": 12, "iteration_s": None})
    assert bench.wall_time_to_step(rows, 8) == pytest.approx(6 * 0.5 + 2 * 2.0)
    assert bench.wall_time_to_step(rows, 12) == pytest.approx(9 * 0.5 + 3 * 2.0)
    assert bench.wall_time_to_step(rows, 13) is None  # a step without a time
    assert bench.wall_time_to_step(rows[1:], 4) is None  # a step missing
    assert bench.wall_time_to_step(rows, None) is None  # the target never reached


def test_the_summary_and_the_json_line_give_means_and_spreads_over_the_repeats():
    repeats = [{"shape": "4x2", "runs": {"exact": run_figures(3.0, 3.0, 0.0, 1.0, 1.0, 192.0, None),
                                         "slow-link": run_figures(1.0, 0.9, 0.1, 3.0, 0.75, 85.3, 2.25, 90.0, 2.2)}},
               {"shape": "4x2", "runs": {"exact": run_figures(3.2, 3.0, 0.0625, 1.0, 1.0, 204.8, None),
                                         "slow-link": run_figures(0.8, 0.9, 0.125, 4.0, None, None, None)}}]
    summ = bench.summarise(repeats, ["exact", "slow-link"])
    sl = summ["slow-link"]
    assert sl["speedup_per_step"]["mean"] == 3.5 and sl["speedup_per_step"]["min"] == 3.0
    assert sl["step_efficiency"] == {"n": 1, "missing": 1, "mean": 0.75, "stdev": 0.0, "min": 0.75, "max": 0.75}
    assert summ["exact"]["time_to_target_speedup"]["mean"] == 1.0
    line = bench.json_line({"summary": summ, "repeats": repeats, "bandwidth_scale": 0.011, "target_step": 64,
                            "window": 16, "codec_speed": {}}, "slow-link")
    # what bench/compress.py merges: numbers at the top level and per method
    assert line["speedup_measured"] == 3.5 and line["prediction_error"] == pytest.approx(0.1125)
    assert line["bandwidth_scale"] == 0.011 and line["bandwidth_scale_computed"] is False
    m = {x["name"]: x for x in line["methods"]}
    assert m["slow-link"]["prediction_error"] == pytest.approx(0.1125) and m["slow-link"]["measured_s"] == 0.9
    assert m["slow-link"]["predicted_s"] == 0.9 and m["slow-link"]["time_to_target_speedup"]["mean"] == 2.25
    assert line["best_time_to_target"] == "slow-link" and line["repeats"] == 2
    assert line["best_wall_time_to_target_speedup"] == 2.2 and m["slow-link"]["wall_time_to_target_s"]["n"] == 1


def test_each_repeat_trains_with_its_own_seed_unless_told():
    assert bench.repeat_seeds("", 3) == [0, 1, 2]
    assert bench.repeat_seeds("0", 3) == [0, 0, 0]
    assert bench.repeat_seeds("4,7", 3) == [4, 7, 4]
    with pytest.raises(ValueError):
        bench.repeat_seeds("-1", 2)


def test_a_warm_start_synchronises_on_its_own_steps_in_the_cycle():
    from dtfm.train.compress import get_compression
    diloco = get_compression("diloco")
    rows = [{"step": s, "iteration_s": 2.0 if diloco.sync_due(s) else 1.0} for s in range(200)]
    got = bench.cycle_iteration_s(rows, diloco.inner_steps, 0, diloco.sync_due)
    assert got["local_median_s"] == 1.0 and got["sync_median_s"] == 2.0
    assert got["iteration_s"] == ((diloco.inner_steps - 1) * 1.0 + 2.0) / diloco.inner_steps
    naive = bench.cycle_iteration_s(rows, diloco.inner_steps, 0)  # every 16th step: the ramp's syncs read as local
    assert naive["local_steps"] != got["local_steps"]


def test_the_measured_rate_counts_each_runs_own_sequences_per_peer():
    """Every run's compute is costed at the rate the exact run achieved: a peer of one pipeline
    computes twice the sequences of a peer of two in the same seconds (twice the rate), and the
    micro-batch count splits the same work differently."""
    def reply(dp: int, micro_batches: int = 4) -> dict:
        return {"stages": 4, "dp": dp, "layer_ranges": [[k, k + 1] for k in range(4)],
                "train": {"micro_batches": micro_batches}}
    two = bench.measured_tflops(reply(2), 0.2)
    assert two > 0
    assert bench.measured_tflops(reply(1), 0.2) == pytest.approx(2 * two)
    assert bench.measured_tflops(reply(2), 0.1) == pytest.approx(2 * two)
    assert bench.measured_tflops(reply(2, micro_batches=2), 0.2) == pytest.approx(two)


def test_the_runs_config_carries_the_schedule_the_allocation_handed_out():
    """The bench predicts a run under its own pipeline schedule (the allocation's warm-ups), as
    the coordinator did."""
    cfg = bench.run_config({"train": {"micro_batches": 16, "pipeline_warmups": "14,8,2,0"}})
    assert (cfg.micro_batches, cfg.warmups(4)) == (16, (14, 8, 2, 0))
    assert bench.run_config({"train": {"micro_batches": 8}}).warmups(4) is None  # (GPipe)
