"""The micro-batch count in the scheduler: the counts a run may take (`micro_batch_options`), the
trainer's flow-control window in the GPipe simulator, and the shape search choosing M with
(S, D) when a run leaves it to the scheduler (`RunModel.auto_micro_batches`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dtfm.sched import (MAX_MICRO_BATCHES, TRAINER_WINDOW_MESSAGES, CostModel, FastestShape, ModelSpec, RunModel,
                        ScheduleInputs, choose_compression, micro_batch_options, simulate_iteration)

# the tiny preset's numbers (dtfm.train's), global batch 16
TINY = RunModel("tiny", 4, 128, 4, 128, 256, 16, 4, 4)
AUTO = dataclasses.replace(TINY, auto_micro_batches=True)
# the layer's time per FLOP against the reference by micro-batch size, as `kind_factors` measures
# a narrow layer on a CPU: small micro-batches run slower per FLOP
KIND = {1: 1.6, 2: 1.4, 4: 1.2, 8: 1.1, 16: 1.0}


def uniform(n: int, one_way_ms: float, gbps: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    d = np.full((n, n), one_way_ms)
    np.fill_diagonal(d, 0.0)
    bw = np.full((n, n), gbps)
    np.fill_diagonal(bw, np.inf)
    return d, bw


def inputs(model: RunModel, one_way_ms: float, *, kind=None, stages=4, dp=1, tflops=0.02) -> ScheduleInputs:
    n = 4
    d, bw = uniform(n, one_way_ms)
    return ScheduleInputs(tuple(str(i) for i in range(n)), ("",) * n, d, bw, np.ones(n), tflops,
                          KIND if kind is None else kind, model, stages=stages, dp=dp, time_budget_s=0.2)


def test_the_counts_divide_the_per_pipeline_batch_within_the_bound():
    assert micro_batch_options(16, 1) == (1, 2, 4, 8, 16)
    assert micro_batch_options(16, 2) == (1, 2, 4, 8)
    assert micro_batch_options(14, 3) == (1, 2, 4)  # 14 // 3 = 4 sequences in the smaller pipeline
    assert micro_batch_options(488, 8) == (1, 61)  # GPT-3 XL's paper batch: 61 of one sequence
    assert micro_batch_options(256, 1) == (1, 2, 4, 8, 16, 32, 64) and MAX_MICRO_BATCHES == 64
    assert micro_batch_options(4, 8) == ()  # a pipeline would get no sequence
    assert AUTO.micro_batch_options(2) == (1, 2, 4, 8) and TINY.micro_batch_options(2) == (4,)
    assert AUTO.d_max == 16 and TINY.d_max == 4  # one micro-batch of one sequence each, or M of them
    assert AUTO.micro_batch_sizes(2) == (1, 2, 4, 8, 16) and TINY.micro_batch_sizes(4) == (1, 2, 4)


def spec_at(m: int, *, layer_s: float | None = 0.01) -> ModelSpec:
    """The tiny model at 1 pipeline of m micro-batches, compute at `layer_s` per layer per micro-batch."""
    tflops = None if layer_s is None else TINY.spec(1, 1.0, m).layer_flops() / layer_s / 1e12
    return TINY.spec(1, tflops, m)


def test_the_window_holds_a_micro_batch_back_one_round_trip_per_window():
    """Up to the window a hop's latency is paid once whatever M; past it, a message waits for
    the acknowledgement of the one a window before: one round trip more per window of
    micro-batches (here compute and transfers are free, so the round trips are the step)."""
    X = np.arange(2).reshape(2, 1)
    d, bw = uniform(2, 100.0, gbps=1e9)
    for M in (1, 4, TRAINER_WINDOW_MESSAGES):
        model = CostModel(d, bw, spec_at(M, layer_s=None).workload(2, 1))
        free = simulate_iteration(model, X, micro_batches=M).pipeline_s
        held = simulate_iteration(model, X, micro_batches=M, window_messages=TRAINER_WINDOW_MESSAGES).pipeline_s
        assert held == pytest.approx(free) == pytest.approx(0.2)  # one hop forward, one back
    model = CostModel(d, bw, spec_at(16, layer_s=None).workload(2, 1))
    assert simulate_iteration(model, X, micro_batches=16).pipeline_s == pytest.approx(0.2)
    # messages 8..15 of each pass wait for the acknowledgements of 0..7: 0.2 s more each way
    assert simulate_iteration(model, X, micro_batches=16, window_messages=8).pipeline_s == pytest.approx(0.6)
    with pytest.raises(ValueError, match="window_messages"):
        simulate_iteration(model, X, micro_batches=16, window_messages=0)


def test_more_micro_batches_where_latency_is_small_against_compute_fewer_where_it_dominates():
    """The search's choice is the simulator's fastest count: on near links the bubble's compute
    is what M shrinks, so the most micro-batches win; across 100 ms links past the window each
    micro-batch pays round trips, and a count within the window wins."""
    near = inputs(AUTO, 0.05, kind={}).solve()
    far = inputs(AUTO, 100.0, kind={}).solve()
    for found in (near, far):
        times = {m: t for s, d, m, t in found.tried_micro}
        assert sorted(times) == [1, 2, 4, 8, 16]
        assert found.micro_batches == min(times, key=times.get) and found.iteration_s == min(times.values())
    assert near.micro_batches == 16
    assert far.micro_batches == TRAINER_WINDOW_MESSAGES < near.micro_batches
    # the per-FLOP speed of the micro-batch counts too: smaller micro-batches are slower, and
    # the gain of 16 over 8 on near links is gone
    slow_small = inputs(AUTO, 0.05).solve()
    t = {m: v for s, d, m, v in slow_small.tried_micro}
    assert slow_small.micro_batches == 8 and t[8] <= t[16] and t[8] < t[4] < t[2] < t[1]


def test_a_fixed_count_is_costed_alone_and_the_note_says_what_it_is_only_when_searched():
    fixed = inputs(TINY, 100.0).solve()
    assert fixed.micro_batches == 4 and fixed.tried_micro == ()
    assert "micro-batch" not in fixed.note(4)
    found = inputs(AUTO, 100.0, kind={}).solve()
    t = {m: v for s, d, m, v in found.tried_micro}
    runner_up = sorted((v, m) for m, v in t.items() if m != found.micro_batches)[0]
    assert found.note(4).startswith(f"4 x 1, 8 micro-batches: predicted {t[8]:.3f} s/step; "
                                    f"{runner_up[1]} micro-batches {runner_up[0]:.3f} s")
    note = FastestShape(type("A", (), {"stages": 2, "dp": 2})(), 0.5, ((2, 2, 0.5), (4, 1, 0.7)), 1,
                        ((2, 2, 1, 0.5), (2, 2, 2, 0.6), (4, 1, 4, 0.7))).note(4)
    assert note == "2 x 2, 1 micro-batch: predicted 0.500 s/step; 2 micro-batches 0.600 s; next 4 x 1 0.700 s (2 shapes tried)"


def test_the_search_spans_every_shape_and_count_and_the_view_file_replays_it(tmp_path):
    inp = inputs(AUTO, 20.0, stages=None, dp=None)
    found = inp.solve()
    shapes = {(s, d) for s, d, _ in found.tried}
    assert shapes == set(inp.shapes()) and (1, 4) in shapes  # D up to the peers: M = 1 leaves the batch room
    for S, D in shapes:
        assert sorted(m for s, d, m, _ in found.tried_micro if (s, d) == (S, D)) == list(micro_batch_options(16, D))
    assert found.iteration_s == min(t for *_, t in found.tried_micro)
    path = tmp_path / "view.json"
    path.write_text(inp.to_json())
    back = ScheduleInputs.read(path)
    assert back.model == AUTO and back.model.auto_micro_batches
    again = back.solve()
    assert (again.alloc.stages, again.alloc.dp, again.micro_batches) == (found.alloc.stages, found.alloc.dp,
                                                                         found.micro_batches)


def test_the_compression_choice_costs_the_window_as_the_simulator_does():
    X = np.arange(2).reshape(2, 1)
    d, bw = uniform(2, 100.0)
    model = CostModel(d, bw, spec_at(16).workload(2, 1))
    for window in (None, 8):
        plan = choose_compression(model, X, micro_batches=16, engine_syncs=True, window_messages=window)
        sim = simulate_iteration(model, X, micro_batches=16, engine_syncs=True, window_messages=window)
        assert plan.iteration_s == pytest.approx(sim.iteration_s)
    assert (choose_compression(model, X, micro_batches=16, window_messages=8).iteration_s
            > choose_compression(model, X, micro_batches=16).iteration_s)
