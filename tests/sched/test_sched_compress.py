"""The scheduler with compression: payload sizes equal the codec's, exact stays the paper's
model bit for bit, closed forms of the compressed costs, and the per-link choice on tables
(a slow link compresses, a fast or hidden one does not, never worse than one global setting)."""

import json

import numpy as np
import pytest
import torch

from dtfm.scenarios import load_scenario
from dtfm.sched import (PAPER_GPT3_XL, REFERENCE_CODEC_SPEED, STEP_EFFICIENCY, WIRE_PRESETS, ChoiceReason, CodecAssignment,
                        CodecSpeed, CompressionOptions, CostModel, DataParallelCodec, PipelineCodec, Workload,
                        choose_compression, compression_options, cost_model, shape_step_efficiency, simulate_iteration,
                        step_efficiency,
                        wire_codecs)
from dtfm.sched.cli import main
from dtfm.train.compress import (COMPRESSION_PRESETS, CompressionConfig, StageCompression, dense_payload_bytes,
                                 measure_compress_cost)

INT8 = PipelineCodec("int8", False, 64)
INT4 = WIRE_PRESETS["pp-int4"][0]
DILOCO = WIRE_PRESETS["diloco"][1]


def net(n, ms, gbps):
    delay = np.full((n, n), float(ms))
    bw = np.full((n, n), float(gbps))
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bw, np.inf)
    return delay, bw


# -- the wire, as train's codec makes it -------------------------------------------------------

def test_wire_presets_are_the_training_presets():
    assert set(WIRE_PRESETS) == set(COMPRESSION_PRESETS)
    for name, cfg in COMPRESSION_PRESETS.items():
        assert wire_codecs(cfg) == WIRE_PRESETS[name], name


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 4096 * 3 + 5])
@pytest.mark.parametrize("method,block", [("int8", 64), ("int4", 64), ("int4", 8), ("int8", 4096)])
def test_pipeline_payload_bytes_are_the_codecs(numel, method, block):
    assert PipelineCodec(method, True, block).payload_bytes(numel, 4) == dense_payload_bytes(numel, method, block)
    assert PipelineCodec().payload_bytes(numel, 4) == 4 * numel


@pytest.mark.parametrize("numel", [70, 1024, 5000, 70_001])
@pytest.mark.parametrize("options", [
    {"dp_method": "diloco", "dp_topk_fraction": 0.25, "dp_value_bits": 4},
    {"dp_method": "diloco", "dp_topk_fraction": 0.01, "dp_value_bits": 2, "dp_chunk_elems": 4096},
    {"dp_method": "diloco", "dp_topk_fraction": 1.0, "dp_value_bits": 8, "dp_chunk_elems": 64},
    {"dp_method": "cocktail", "dp_random_fraction": 0.1, "dp_topk_fraction": 0.2, "dp_value_bits": 4},
    {"dp_method": "cocktail", "dp_random_fraction": 0.5, "dp_topk_fraction": 0.05, "dp_value_bits": 2},
])
def test_dp_payload_bytes_are_the_stage_compressions(numel, options):
    cfg = CompressionConfig(**options)
    params = {"w": torch.nn.Parameter(torch.zeros(numel))}
    _, codec = wire_codecs(cfg)
    assert codec.payload_bytes(numel) == StageCompression(cfg, params, 0).payload_bytes()
    assert codec.period_steps == (cfg.inner_steps if cfg.dp_method == "diloco" else 1)


def test_codecs_normalise_what_they_do_not_use():
    assert DataParallelCodec("exact", 0.3, 0.2, 4, 64, 9) == DataParallelCodec()
    assert DataParallelCodec("cocktail", 0.1, 0.2, 4, 1024, 16) == DataParallelCodec("cocktail", 0.1, 0.2, 4, 1024, 1)
    assert PipelineCodec("exact", True, 128) == PipelineCodec()
    with pytest.raises(ValueError):
        CompressionOptions(pp=(INT4,))  # exact must come first
    with pytest.raises(ValueError):
        compression_options(["zip"])
    opts = compression_options(["auto"])
    assert [c.method for c in opts.pp] == ["exact", "int8", "int4"]
    assert [c.method for c in opts.dp] == ["exact", "diloco", "cocktail"]
    assert compression_options(["exact"]).exact


# -- the cost model ------------------------------------------------------------------------------

def test_exact_options_give_the_papers_matrices_and_costs_bit_for_bit():
    sc = load_scenario("worldwide")
    dl, bw = sc.delay_ms(), sc.bandwidth_gbps()
    plain = cost_model(dl, bw, PAPER_GPT3_XL, 8, 8)
    exact = cost_model(dl, bw, PAPER_GPT3_XL, 8, 8, compression=compression_options(["exact"], REFERENCE_CODEC_SPEED))
    for name in ("hop", "dp_a", "dp_b"):
        assert np.array_equal(getattr(plain, name), getattr(exact, name)), name
    X = np.random.default_rng(3).permutation(64).reshape(8, 8)
    assert plain.breakdown(X) == exact.breakdown(X)
    assert simulate_iteration(plain, X) == simulate_iteration(exact, X)
    assert exact.extensions == plain.extensions


def test_compressed_hop_and_dp_costs_in_closed_form():
    delay, bw = net(4, 10, 2.0)
    speed = CodecSpeed(int8_encode_ns_per_elem=3.0, int8_decode_ns_per_elem=1.0, sparse_encode_ns_per_elem=20.0,
                       sparse_decode_ns_per_elem=5.0)
    wl = Workload(stages=2, dp=2, layers=2, grad_gb_total=2 * 4.096e-3, act_gb=2 * 8.192e-3, micro_batches=2)
    m = CostModel(delay, bw, wl, compression=CompressionOptions((PipelineCodec(), INT8), (DataParallelCodec(), DILOCO),
                                                                 speed))
    # activations: 8.192e6 elements of 2 B per direction, 2 messages of 4.096e6
    n_mb = 4_096_000
    ratio = dense_payload_bytes(n_mb, "int8", 64) / (2 * n_mb)
    hop_int8 = 0.010 + wl.act_gb * ratio * 8 / 2.0 + 2 * n_mb * 4.0e-9
    hop_exact = 0.010 + wl.act_gb * 8 / 2.0
    assert m.link_hop(INT8)[0, 1] == pytest.approx(hop_int8, rel=1e-12)
    assert m.hop[0, 1] == pytest.approx(min(hop_int8, hop_exact), rel=1e-12)
    # DP: a stage of 4.096e-3 GB = 1.024e6 fp32 parameters; one diloco payload to the other member
    numel = 1_024_000
    payload_gb = DILOCO.payload_bytes(numel) / 1e9
    sync = 0.010 + payload_gb * 8 / 2.0 + numel * (20.0 + 2 * 5.0) * 1e-9
    X = np.array([[0, 1], [2, 3]])
    rows = m.dp_rows_codec(X, np.array([1, 1]), DILOCO, amortised=False)
    assert rows == pytest.approx(np.full((2, 2), sync), rel=1e-9)
    exact_sync = 2 * (0.010 + 4.096e-3 * 8 / (2 * 2.0))
    assert m.breakdown(X).dp_s == pytest.approx(min(exact_sync, sync / 16), rel=1e-9)


def test_diloco_is_amortised_over_its_cycle_in_the_simulator():
    delay, bw = net(2, 10, 1.0)
    wl = Workload(stages=1, dp=2, layers=1, grad_gb_total=0.1, act_gb=0.0, micro_batches=2, layer_compute_s=0.3)
    m = CostModel(delay, bw, wl, compression=CompressionOptions(dp=(DataParallelCodec(), DILOCO)))
    X = np.array([[0, 1]])
    r = simulate_iteration(m, X, codecs=CodecAssignment((), (DILOCO,)))
    sync = r.allreduce_s[0]
    assert sync > 0 and r.sync_every == (16,)
    assert r.iteration_s == pytest.approx(2 * 0.3 + sync / 16)


# -- the choice, on tables ---------------------------------------------------------------------

def two_pipelines(slow_gbps, fast_gbps, *, micro_batches=1, layer_compute_s=None, speed=CodecSpeed(),
                  peer_speeds=()):
    """Two pipelines of two stages: peers 0 -> 1 over a slow link, 2 -> 3 over a fast one;
    DP pairs (0, 2) and (1, 3) on fast links."""
    delay, bw = net(4, 1, fast_gbps)
    bw[0, 1] = bw[1, 0] = slow_gbps
    wl = Workload(stages=2, dp=2, layers=2, grad_gb_total=1e-4, act_gb=0.05, micro_batches=micro_batches,
                  layer_compute_s=layer_compute_s)
    opts = compression_options(["pp-int8", "pp-int4", "diloco"], speed)
    opts = CompressionOptions(opts.pp, opts.dp, speed, peer_speeds)
    return CostModel(delay, bw, wl, compression=opts), np.array([[0, 2], [1, 3]])


def link(plan, stage, pipeline):
    return next(c for c in plan.links if c.stage == stage and c.pipeline == pipeline)


def test_a_slow_link_compresses_and_a_fast_one_does_not():
    m, X = two_pipelines(0.1, 10.0)
    plan = choose_compression(m, X)
    slow, fast = link(plan, 0, 0), link(plan, 0, 1)
    assert slow.codec == INT4 and slow.reason is ChoiceReason.SLOW and slow.saving_s > 0
    assert fast.codec.exact and fast.reason is ChoiceReason.OFF_CRITICAL_PATH and fast.saving_s == 0
    assert plan.iteration_s < plan.exact_iteration_s
    assert plan.iteration_s <= plan.best_global_iteration_s
    # the best single setting compresses the fast link too, for nothing
    assert plan.best_global[0] == INT4.name


@pytest.mark.parametrize("compute_s,expect", [(5.0, ChoiceReason.HIDDEN), (1e-6, ChoiceReason.SLOW)])
def test_a_link_hidden_behind_compute_stays_exact(compute_s, expect):
    # 8 micro-batches; the slow link's transfer per micro-batch is 0.05 / 8 GB at 1 Gbps = 0.05 s,
    # far below a forward pass of 5 / 3 s, so the compute hides all but the last micro-batch's,
    # and coding every micro-batch on the peers' compute timeline costs more than that tail;
    # with no compute the transfers are the iteration.
    m, X = two_pipelines(1.0, 100.0, micro_batches=8, layer_compute_s=compute_s, speed=REFERENCE_CODEC_SPEED)
    plan = choose_compression(m, X)
    assert link(plan, 0, 0).reason is expect
    assert link(plan, 0, 0).codec.exact == (expect is ChoiceReason.HIDDEN)


def test_a_minimum_saving_keeps_a_hidden_link_exact_even_when_coding_is_free():
    # free coding: compressing the hidden link still shortens the exposed last transfer (about
    # 0.2 % of the 45 s iteration); a 1 % minimum saving leaves it exact
    m, X = two_pipelines(1.0, 100.0, micro_batches=8, layer_compute_s=5.0)
    assert not link(choose_compression(m, X), 0, 0).codec.exact
    plan = choose_compression(m, X, min_saving_fraction=0.01)
    assert link(plan, 0, 0).codec.exact and link(plan, 0, 0).reason is ChoiceReason.HIDDEN
    assert plan.iteration_s <= plan.best_global_iteration_s + 0.01 * plan.exact_iteration_s
    with pytest.raises(ValueError):
        choose_compression(m, X, min_saving_fraction=1.0)


def test_coding_slower_than_the_link_stays_exact():
    slow_cpu = CodecSpeed(int8_encode_ns_per_elem=1e4, int8_decode_ns_per_elem=1e4, int4_encode_ns_per_elem=1e4,
                          int4_decode_ns_per_elem=1e4)
    m, X = two_pipelines(0.1, 10.0, speed=slow_cpu)
    plan = choose_compression(m, X)
    assert link(plan, 0, 0).codec.exact and link(plan, 0, 0).reason is ChoiceReason.CODING_TOO_SLOW
    assert all(c.codec.exact for c in plan.links)


def test_a_slow_dp_group_compresses_and_a_fast_one_does_not():
    delay, bw = net(4, 1, 10.0)
    bw[0, 2] = bw[2, 0] = 0.05  # stage 0's DP pair is slow
    # stage 1 ends its backward pass 0.4 s before stage 0: its group's exact all-reduce (0.08 s)
    # overlaps stage 0's backward, stage 0's (16 s over the slow pair) ends the iteration
    wl = Workload(stages=2, dp=2, layers=2, grad_gb_total=0.2, act_gb=1e-4, micro_batches=1, layer_compute_s=0.6)
    m = CostModel(delay, bw, wl, compression=compression_options(["diloco"]))
    plan = choose_compression(m, np.array([[0, 2], [1, 3]]))
    g0, g1 = plan.groups
    assert g0.codec == DILOCO and g0.reason is ChoiceReason.SLOW and g0.saving_s > 0 and g0.sync_every == 16
    assert g1.codec.exact and g1.saving_s == 0 and g1.reason is ChoiceReason.OFF_CRITICAL_PATH


def test_the_choice_is_deterministic_and_never_worse_than_one_global_setting():
    rng = np.random.default_rng(7)
    for trial in range(12):
        n, S, D = 6, 3, 2
        delay = rng.uniform(1, 80, (n, n))
        bw = rng.choice([0.05, 0.5, 5.0], (n, n))
        np.fill_diagonal(delay, 0)
        np.fill_diagonal(bw, np.inf)
        M = int(rng.choice([1, 4]))
        wl = Workload(stages=S, dp=D, layers=S, grad_gb_total=float(rng.uniform(0.01, 0.3)),
                      act_gb=float(rng.uniform(0.001, 0.05)), micro_batches=M,
                      layer_compute_s=None if trial % 2 else float(rng.uniform(0.01, 0.5)))
        m = CostModel(delay, bw, wl, compression=compression_options(["auto"], REFERENCE_CODEC_SPEED))
        X = rng.permutation(n).reshape(S, D)
        plan = choose_compression(m, X)
        assert plan == choose_compression(m, X)
        tol = 1e-9 * plan.best_global_iteration_s
        assert plan.iteration_s <= plan.best_global_iteration_s + tol
        assert plan.iteration_s <= plan.exact_iteration_s + tol
        assert simulate_iteration(m, X, codecs=plan.assignment).iteration_s == pytest.approx(plan.iteration_s)
        for c in list(plan.links) + list(plan.groups):
            assert (c.saving_s > 0) == (not c.codec.exact), c


# -- the choice by time to a target loss ---------------------------------------------------------

def test_a_plans_step_efficiency_is_its_least_efficient_codec_per_axis():
    table = {"exact": 1.0, "int4": 0.9, "int8": 1.0, "diloco": 0.5}
    assert step_efficiency(CodecAssignment.uniform(3, 2), table) == 1.0
    assert step_efficiency(CodecAssignment.uniform(3, 2, INT4, DILOCO), table) == pytest.approx(0.45)
    # one DiLoCo group of three costs the run as all three do; int8 next to int4 costs int4's
    mixed = CodecAssignment(((INT8, INT4), (INT8, PipelineCodec())), (DataParallelCodec(), DILOCO, DataParallelCodec()))
    assert step_efficiency(mixed, table) == pytest.approx(0.45)
    assert step_efficiency(CodecAssignment.uniform(2, 2, INT4, DILOCO)) == STEP_EFFICIENCY["diloco"]
    # one pipeline's groups of one member synchronise nothing: a uniform assignment gives them no
    # DP codec, as the trainer runs them, so they cost no steps (one stage or several)
    assert CodecAssignment.uniform(3, 1, INT4, DILOCO).dp == (DataParallelCodec(),) * 3
    assert CodecAssignment.uniform(3, 2, INT4, DILOCO).dp == (DILOCO,) * 3
    assert step_efficiency(CodecAssignment.uniform(3, 1, INT4, DILOCO), table) == pytest.approx(0.9)
    assert step_efficiency(CodecAssignment.uniform(1, 1, PipelineCodec(), DILOCO), table) == 1.0
    assert step_efficiency(CodecAssignment.uniform(1, 2, PipelineCodec(), DILOCO), table) == 0.5


def test_a_shapes_step_efficiency_leaves_out_an_axis_with_nothing_to_send():
    table = {"exact": 1.0, "int4": 0.9, "int8": 1.0, "diloco": 0.5}
    both = CompressionOptions((PipelineCodec(), INT4), (DataParallelCodec(), DILOCO))
    assert shape_step_efficiency(None, 4, 2, table) == 1.0
    assert shape_step_efficiency(both, 4, 2, table) == pytest.approx(0.45)
    assert shape_step_efficiency(both, 4, 1, table) == pytest.approx(0.9)  # one pipeline: no DP group
    assert shape_step_efficiency(both, 1, 2, table) == pytest.approx(0.5)  # one stage: no link
    assert shape_step_efficiency(both, 1, 1, table) == 1.0
    assert shape_step_efficiency(CompressionOptions(), 4, 2, table) == 1.0  # exact options


def test_by_time_to_loss_a_link_that_saves_less_than_the_error_stays_compressed():
    # the hidden link of the test above: exact saves 0.1 s of a 45 s iteration by the simulator
    # (the coding on the compute timeline), far less than a 10 % error: both links compress
    m, X = two_pipelines(1.0, 100.0, micro_batches=8, layer_compute_s=5.0, speed=REFERENCE_CODEC_SPEED)
    assert all(c.codec.exact for c in choose_compression(m, X).links)  # by iteration time: exact
    plan = choose_compression(m, X, efficiency=STEP_EFFICIENCY, error_fraction=0.1)
    assert all(not c.codec.exact and c.reason is ChoiceReason.WITHIN_ERROR for c in plan.links)
    exact_t = plan.exact_iteration_s
    assert exact_t < plan.iteration_s <= 1.1 * exact_t
    assert all(c.saving_s <= 0 for c in plan.links)  # exact would be (a little) faster, each on its own
    # with no error to allow for, the simulator's faster plan wins: exact
    plan0 = choose_compression(m, X, efficiency=STEP_EFFICIENCY, error_fraction=0.0)
    assert all(c.codec.exact for c in plan0.links) and plan0.iteration_s == exact_t
    with pytest.raises(ValueError):
        choose_compression(m, X, efficiency=STEP_EFFICIENCY, error_fraction=1.0)
    with pytest.raises(ValueError):
        choose_compression(m, X, efficiency={**STEP_EFFICIENCY, "int4": 0.0})


def dp_pair(slow_gbps: float):
    """Two stages x two pipelines on 10 Gbps, stage 0's DP pair (0, 2) at `slow_gbps`."""
    delay, bw = net(4, 1, 10.0)
    bw[0, 2] = bw[2, 0] = slow_gbps
    wl = Workload(stages=2, dp=2, layers=2, grad_gb_total=0.2, act_gb=1e-4, micro_batches=1, layer_compute_s=0.6)
    return CostModel(delay, bw, wl, compression=compression_options(["diloco"])), np.array([[0, 2], [1, 3]])


@pytest.mark.parametrize("slow_gbps,diloco_efficiency,compressed", [
    (6.0, 0.8, False),  # DiLoCo saves 10 % per step: 1 / 0.8 times the steps cost more than that
    (6.0, 1.0, True),  # were its steps worth exact's, the 10 % would be taken
    (4.0, 0.8, True),  # 14 % per step: exact would be 6.6 % faster to the loss, within the 10 % error
    (0.05, 0.8, True),  # 93 % per step: far more than the lost steps
])
def test_the_step_efficiency_decides_a_dp_group_by_time_to_loss(slow_gbps, diloco_efficiency, compressed):
    m, X = dp_pair(slow_gbps)
    by_time = choose_compression(m, X)
    assert not by_time.groups[0].codec.exact  # per step, DiLoCo is faster in every case
    table = {**STEP_EFFICIENCY, "diloco": diloco_efficiency}
    plan = choose_compression(m, X, efficiency=table, error_fraction=0.1)
    g0 = plan.groups[0]
    assert (not g0.codec.exact) == compressed
    if not compressed:
        assert g0.reason is ChoiceReason.STEP_EFFICIENCY and plan.iteration_s == plan.exact_iteration_s
    else:  # the second group, off the critical path, compresses along: its lost steps are already paid
        assert all(not g.codec.exact for g in plan.groups)
        assert plan.groups[1].reason is ChoiceReason.WITHIN_ERROR


def test_by_time_to_loss_the_plan_is_within_the_error_of_every_single_setting():
    rng = np.random.default_rng(11)
    err = 0.1
    for trial in range(10):
        n, S, D = 6, 3, 2
        delay = rng.uniform(1, 80, (n, n))
        bw = rng.choice([0.05, 0.5, 5.0], (n, n))
        np.fill_diagonal(delay, 0)
        np.fill_diagonal(bw, np.inf)
        wl = Workload(stages=S, dp=D, layers=S, grad_gb_total=float(rng.uniform(0.01, 0.3)),
                      act_gb=float(rng.uniform(0.001, 0.05)), micro_batches=int(rng.choice([1, 4])),
                      layer_compute_s=None if trial % 2 else float(rng.uniform(0.01, 0.5)))
        m = CostModel(delay, bw, wl, compression=compression_options(["auto"], REFERENCE_CODEC_SPEED))
        X = rng.permutation(n).reshape(S, D)
        plan = choose_compression(m, X, efficiency=STEP_EFFICIENCY, error_fraction=err)
        assert plan == choose_compression(m, X, efficiency=STEP_EFFICIENCY, error_fraction=err)

        def to_loss(codecs: CodecAssignment) -> float:
            return simulate_iteration(m, X, codecs=codecs).iteration_s / step_efficiency(codecs)
        best = min(to_loss(CodecAssignment.uniform(S, D, pp, dp)) for pp in m.options.pp for dp in m.options.dp)
        assert to_loss(plan.assignment) <= (1 + err) ** 2 * best * (1 + 1e-9)
        # a link or group left exact saves more than the error against compressing it alone
        for c in plan.links:
            if c.codec.exact:
                for k in m.options.pp[1:]:
                    pp = [list(r) for r in plan.assignment.pp]
                    pp[c.stage][c.pipeline] = k
                    alt = CodecAssignment(tuple(map(tuple, pp)), plan.assignment.dp)
                    assert to_loss(alt) > to_loss(plan.assignment) * (1 + 1e-9), (trial, c)


def test_search_knowing_compression_costs_its_allocation_with_the_cheapest_codecs():
    sc = load_scenario("worldwide").scaled(16)
    opts = compression_options(["auto"])
    from dtfm.sched import solve
    alloc = solve(sc.delay_ms(), sc.bandwidth_gbps(), PAPER_GPT3_XL, stages=4, dp=4, regions=sc.peer_regions(),
                  generations=1, time_budget_s=30, compression=opts)
    m = cost_model(sc.delay_ms(), sc.bandwidth_gbps(), PAPER_GPT3_XL, 4, 4, compression=opts)
    assert alloc.cost == m.breakdown(alloc.matrix)
    exact = cost_model(sc.delay_ms(), sc.bandwidth_gbps(), PAPER_GPT3_XL, 4, 4).breakdown(alloc.matrix)
    assert alloc.cost.paper_s < exact.paper_s


def test_an_assignment_round_trips_as_plain_data_and_refuses_anything_else():
    a = CodecAssignment(((INT8, INT4, PipelineCodec()), (INT4, INT4, INT4)), (DILOCO, DataParallelCodec(), DILOCO))
    d = json.loads(json.dumps(a.to_dict()))
    assert CodecAssignment.from_dict(d, 3, 3) == a
    bad = [None, [], {**d, "extra": 1}, {**d, "dp": [0, 1]}, {**d, "dp": [0, 1, 5]}, {**d, "pp": [[0, 1, 2]]},
           {**d, "pp": [[0, 1, True], [0, 0, 0]]}, {**d, "pp_codecs": [{"method": "zip"}]},
           {**d, "dp_codecs": [{**d["dp_codecs"][0], "inner_steps": "16"}]},
           {**d, "dp_codecs": [{**d["dp_codecs"][0], "inner_steps": 0}]}, {**d, "pp_codecs": [1] * 9}]
    for b in bad:
        with pytest.raises(ValueError):
            CodecAssignment.from_dict(b, 3, 3)
    with pytest.raises(ValueError):
        CodecAssignment.from_dict(d, 3, 2)


# -- the calibration and the command line ------------------------------------------------------

def test_measure_compress_cost_gives_positive_figures():
    speed = measure_compress_cost(elements=4096, repeats=1)
    assert speed.int8_encode_ns_per_elem > 0 and speed.int4_decode_ns_per_elem > 0
    assert speed.sparse_encode_ns_per_elem > 0 and speed.hadamard_ns_per_elem >= 0
    assert CodecSpeed.from_dict(speed.to_dict()) == speed


def test_cli_shows_which_links_compress_and_why(capsys, tmp_path):
    argv = ["solve", "--scenario", "worldwide", "--peers", "8", "--stages", "2", "--dp", "4", "--generations", "1",
            "--time-budget", "30", "--compress", "auto", "--codec-speed", "free"]
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    plan = doc["compression"]
    assert doc["simulated_iteration_s"] == plan["iteration_s"] <= plan["best_global"]["iteration_s"] * (1 + 1e-9)
    assert len(plan["links"]) == 1 * 4 and len(plan["groups"]) == 2
    assert any(g["codec"] != "exact" and g["saving_s"] > 0 for g in plan["groups"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "compression: predicted iteration" in text and "saves" in text
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps(REFERENCE_CODEC_SPEED.to_dict()))
    assert main(argv[:-1] + [str(speed), "--compress", "pp-int8,diloco"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("extra,message", [
    (["--compress", "zip"], "--compress: unknown compression 'zip'"),
    (["--compress", "auto", "--codec-speed", "/nonexistent.json"], "--codec-speed: cannot read"),
])
def test_cli_compression_errors_exit_1(capsys, extra, message):
    rc = main(["solve", "--scenario", "worldwide", "--peers", "8", "--generations", "1", *extra])
    err = capsys.readouterr().err
    assert rc == 1 and message in err and "Traceback" not in err


# -- each peer's own coding speed --------------------------------------------------------------

def slower(speed: CodecSpeed, factor: float) -> CodecSpeed:
    return CodecSpeed.from_vector([v * factor for v in speed.to_vector()])


def test_a_codec_speed_round_trips_as_the_vector_gossip_carries():
    from dtfm.gossip.records import CODEC_NS_LEN
    from dtfm.sched import CODEC_SPEED_LEN
    assert CODEC_SPEED_LEN == CODEC_NS_LEN == len(REFERENCE_CODEC_SPEED.to_vector())
    assert CodecSpeed.from_vector(REFERENCE_CODEC_SPEED.to_vector()) == REFERENCE_CODEC_SPEED
    assert REFERENCE_CODEC_SPEED.to_vector()[0] == REFERENCE_CODEC_SPEED.int8_encode_ns_per_elem
    for bad in ([1.0] * 6, [1.0] * 8, [1.0] * 6 + [float("nan")], [1.0] * 6 + [-1.0]):
        with pytest.raises(ValueError):
            CodecSpeed.from_vector(bad)


def test_per_peer_speeds_all_equal_to_the_common_speed_change_nothing_bit_for_bit():
    sc = load_scenario("worldwide").scaled(8)
    dl, bw = sc.delay_ms(), sc.bandwidth_gbps()
    common = compression_options(["auto"], REFERENCE_CODEC_SPEED)
    per_peer = CompressionOptions(common.pp, common.dp, CodecSpeed(), (REFERENCE_CODEC_SPEED,) * 8)
    wl = Workload(stages=2, dp=4, layers=4, grad_gb_total=0.3, act_gb=0.02, micro_batches=4, layer_compute_s=0.05)
    a, b = CostModel(dl, bw, wl, compression=common), CostModel(dl, bw, wl, compression=per_peer)
    for name in ("hop", "pp_choice", "dp_a", "dp_b"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    X = np.random.default_rng(1).permutation(8).reshape(2, 4)
    assert a.breakdown(X) == b.breakdown(X)
    assert simulate_iteration(a, X, engine_syncs=True) == simulate_iteration(b, X, engine_syncs=True)
    assert choose_compression(a, X) == choose_compression(b, X)


def test_per_peer_speeds_must_name_every_peer():
    delay, bw = net(4, 1, 1.0)
    wl = Workload(stages=2, dp=2, layers=2, grad_gb_total=1e-3, act_gb=1e-3, micro_batches=1)
    with pytest.raises(ValueError, match="3 peers, the network has 4"):
        CostModel(delay, bw, wl, compression=CompressionOptions(peer_speeds=(CodecSpeed(),) * 3))
    with pytest.raises(ValueError):
        CompressionOptions(peer_speeds=({"int8_encode_ns_per_elem": 1.0},))  # type: ignore[arg-type]


@pytest.mark.parametrize("slow_peer,compresses", [(None, True), (0, False), (1, False), (2, True)])
def test_a_peer_coding_100x_slower_keeps_its_own_link_exact(slow_peer, compresses):
    # the slow link 0 -> 1 compresses at the reference CPU's speed; when its sender (0) or its
    # receiver (1) codes 100 times slower, coding costs more than the transfer saves; a slow
    # coder elsewhere (2, on the fast link) changes nothing there
    speeds = [REFERENCE_CODEC_SPEED] * 4
    if slow_peer is not None:
        speeds[slow_peer] = slower(REFERENCE_CODEC_SPEED, 100)
    m, X = two_pipelines(0.1, 10.0, speed=REFERENCE_CODEC_SPEED, peer_speeds=tuple(speeds))
    assert (m.pp_choice[0, 1] != 0) == compresses  # the cost model's cheapest codec on the hop
    plan = choose_compression(m, X)
    slow = link(plan, 0, 0)
    assert (not slow.codec.exact) == compresses
    if not compresses:
        assert slow.reason is ChoiceReason.CODING_TOO_SLOW
    assert link(plan, 0, 1).codec.exact


def test_the_simulator_codes_on_the_sender_and_the_receiver_at_their_own_speeds():
    # one pipeline of two stages, one micro-batch, no compute: the iteration is forward (0
    # encodes, transfer, 1 decodes) then backward (1 encodes, transfer, 0 decodes)
    delay, bw = net(3, 5, 1.0)
    wl = Workload(stages=2, dp=1, layers=2, grad_gb_total=1e-3, act_gb=4e-3, micro_batches=1)
    speeds = (CodecSpeed(int4_encode_ns_per_elem=10.0, int4_decode_ns_per_elem=1.0),
              CodecSpeed(int4_encode_ns_per_elem=100.0, int4_decode_ns_per_elem=1000.0),
              CodecSpeed(int4_encode_ns_per_elem=1e4, int4_decode_ns_per_elem=1e4))  # a spare
    int4 = PipelineCodec("int4", False, 64)
    m = CostModel(delay, bw, wl, compression=CompressionOptions((PipelineCodec(), int4), peer_speeds=speeds))
    codecs = CodecAssignment(((int4,),), (DataParallelCodec(),) * 2)
    _, numel = m.pp_messages()
    wire = 2 * (0.005 + wl.act_gb * m.pp_ratio(int4) * 8 / 1.0)
    fwd = simulate_iteration(m, np.array([[0], [1]]), codecs=codecs).iteration_s
    assert fwd == pytest.approx(wire + numel * (10.0 + 1000.0 + 100.0 + 1.0) * 1e-9, rel=1e-9)
    # the same allocation the other way round: 1 sends first; the coding is the same sum
    back = simulate_iteration(m, np.array([[1], [0]]), codecs=codecs).iteration_s
    assert back == pytest.approx(fwd, rel=1e-9)
    # the cost model's hop counts the mean of the two directions' coding
    assert m.link_hop(int4)[0, 1] == pytest.approx(wire / 2 + numel * (10.0 + 1000.0 + 100.0 + 1.0) / 2 * 1e-9)
    # a slower coder on the pipeline makes it slower; a slow spare changes nothing
    faster = CostModel(delay, bw, wl, compression=CompressionOptions((PipelineCodec(), int4),
                                                                      peer_speeds=(speeds[0], speeds[0], CodecSpeed())))
    assert simulate_iteration(faster, np.array([[0], [1]]), codecs=codecs).iteration_s < fwd
    m_spare = CostModel(delay, bw, wl, compression=CompressionOptions((PipelineCodec(), int4),
                                                                       peer_speeds=speeds[:2] + (speeds[0],)))
    assert simulate_iteration(m_spare, np.array([[0], [1]]), codecs=codecs).iteration_s == fwd


def test_a_dp_member_codes_its_sync_at_its_own_speed():
    delay, bw = net(3, 10, 2.0)
    wl = Workload(stages=1, dp=3, layers=1, grad_gb_total=4.096e-3, act_gb=0.0, micro_batches=1)
    fast = CodecSpeed(sparse_encode_ns_per_elem=20.0, sparse_decode_ns_per_elem=5.0)
    slow = CodecSpeed(sparse_encode_ns_per_elem=2000.0, sparse_decode_ns_per_elem=500.0)
    m = CostModel(delay, bw, wl, compression=CompressionOptions(dp=(DataParallelCodec(), DILOCO),
                                                                peer_speeds=(fast, slow, fast)))
    numel = 1_024_000  # fp32 parameters of the stage
    wire = 2 * (0.010 + DILOCO.payload_bytes(numel) / 1e9 * 8 / 2.0)  # a payload from each other member
    rows = m.dp_rows_codec(np.array([[0, 1, 2]]), np.array([1]), DILOCO, amortised=False)[0]
    # each member encodes its own payload and decodes all three
    assert rows[0] == pytest.approx(wire + numel * (20.0 + 3 * 5.0) * 1e-9, rel=1e-9)
    assert rows[1] == pytest.approx(wire + numel * (2000.0 + 3 * 500.0) * 1e-9, rel=1e-9)
    assert rows[2] == rows[0]
    X = np.array([[0, 1, 2]])
    uniform = CostModel(delay, bw, wl, compression=CompressionOptions(dp=(DataParallelCodec(), DILOCO), speed=fast))
    codecs = CodecAssignment((), (DILOCO,))
    assert (simulate_iteration(m, X, codecs=codecs).allreduce_s[0]
            > simulate_iteration(uniform, X, codecs=codecs).allreduce_s[0])
