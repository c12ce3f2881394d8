"""Pipeline + data-parallel training equals single-process training of the whole model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtfm.train import (GPTSpec, LocalCluster, Plan, TrainConfig, list_checkpoints, load_checkpoint,
                        load_corpus, reference_state, reference_step, save_checkpoint)

SPEC = GPTSpec("oracle", n_layer=4, n_embd=32, n_head=4, seq_len=16)
CFG = TrainConfig(global_batch_seqs=16, micro_batches=4, lr=3e-3, comm_timeout_s=20.0)
RTOL = 1e-5
STEPS = 5


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=256 << 10)


def _reference(spec, cfg, corpus, steps):
    ref = reference_state(spec, cfg)
    losses = [reference_step(ref, corpus) for _ in range(steps)]
    return losses, ref


_REF_CACHE: dict = {}


def reference(spec, cfg, corpus, steps=STEPS):
    key = (spec, cfg, steps)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = _reference(spec, cfg, corpus, steps)
    return _REF_CACHE[key]


def gathered_params(cluster: LocalCluster) -> dict[str, torch.Tensor]:
    """Every parameter by name, from pipeline 0; replicas in other pipelines must be identical."""
    out = {}
    for peer in cluster.plan.pipeline(0):
        out.update({n: p.detach() for n, p in cluster.states[peer].params.items()})
    for d in range(1, cluster.plan.dp):
        for s, peer in enumerate(cluster.plan.pipeline(d)):
            other = cluster.states[cluster.plan.pipeline(0)[s]].params
            for n, p in cluster.states[peer].params.items():
                assert torch.equal(p, other[n]), f"replica {peer} differs in {n}"
    return out


def assert_matches(losses, params, ref_losses, ref_state):
    """Losses within RTOL per step; parameters within RTOL relative over the whole model.

    Per tensor the bound is looser: tensors whose gradient is nearly zero (early attention
    query/key weights) see rounding noise scaled up by Adam's normalisation.
    """
    assert len(losses) == len(ref_losses)
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= RTOL * abs(want), (losses, ref_losses)
    assert set(params) == set(ref_state.params)
    names = sorted(ref_state.params)
    want = torch.cat([ref_state.params[n].detach().reshape(-1) for n in names])
    got = torch.cat([params[n].reshape(-1) for n in names])
    err = float((got - want).norm() / want.norm())
    assert err <= RTOL, f"parameters differ by {err:.2e} relative"
    for n in names:
        w = ref_state.params[n].detach()
        assert float((params[n] - w).norm() / w.norm()) <= 10 * RTOL, n


@pytest.mark.parametrize("stages,dp", [(2, 2), (4, 1), (1, 4)])
def test_pipeline_and_dp_match_single_process(corpus, stages, dp):
    ref_losses, ref = reference(SPEC, CFG, corpus)
    with LocalCluster(SPEC, CFG, Plan.grid(SPEC.n_layer, stages, dp), corpus) as cl:
        losses = cl.run(STEPS)
        assert_matches(losses, gathered_params(cl), ref_losses, ref)
    assert losses[-1] < losses[0]


@pytest.fixture(scope="module")
def gpipe_run(corpus):
    """3 steps of 4 stages x 2 pipelines under GPipe (the default schedule): the losses and every
    parameter."""
    with LocalCluster(SPEC, CFG, Plan.grid(SPEC.n_layer, 4, 2), corpus) as cl:
        return cl.run(3), {n: p.clone() for n, p in gathered_params(cl).items()}


@pytest.mark.parametrize("warmups", ["4,4,4,4", "3,2,1,0", "4,3,1,0", "0,0,0,0", "2,2,2,2", "9,5,4,0"])
def test_every_schedule_of_the_1f1b_family_trains_the_same_bits_as_gpipe(corpus, gpipe_run, warmups):
    """Each stage's order of forwards and backwards (`pipeline_warmups`: 1F1B with any warm-up
    that does not rise along the pipeline, GPipe at M) changes when a link carries what, never
    the result: backwards run in micro-batch order, so every parameter is the same bits."""
    plan = Plan.grid(SPEC.n_layer, 4, 2)
    gpipe_losses, gpipe = gpipe_run
    cfg = dataclasses.replace(CFG, pipeline_warmups=warmups)
    with LocalCluster(SPEC, cfg, plan, corpus) as cl:
        assert cl.run(3) == gpipe_losses
        assert all(torch.equal(p, gpipe[n]) for n, p in gathered_params(cl).items())


def test_the_config_and_the_simulator_bound_warm_ups_alike():
    """TrainConfig checks its warm-ups without importing the scheduler (the daemon's light
    commands load no numpy); the two bounds are one."""
    from dtfm.sched.simulate import MAX_WARMUP as SCHED_MAX
    from dtfm.train.spec import MAX_WARMUP
    assert MAX_WARMUP == SCHED_MAX
    # a stage trained under one schedule goes on under another, and under nothing else changed
    cfg = dataclasses.replace(CFG, pipeline_warmups="3,2,1,0")
    assert cfg.trains_as(CFG) and CFG.trains_as(cfg) and not dataclasses.replace(cfg, lr=1e-3).trains_as(CFG)


def test_a_schedule_that_would_deadlock_or_names_other_stages_is_refused(corpus):
    with pytest.raises(ValueError, match="may not warm up with more forwards"):
        dataclasses.replace(CFG, pipeline_warmups="0,1,2,3")  # stage 1 would wait for a backward stage 0 runs later
    with pytest.raises(ValueError, match="must be in \\[0, 65536\\]"):
        dataclasses.replace(CFG, pipeline_warmups="70000,0")
    with pytest.raises(ValueError, match="comma-separated"):
        dataclasses.replace(CFG, pipeline_warmups="4;3")
    cfg = dataclasses.replace(CFG, pipeline_warmups="4,3")
    with LocalCluster(SPEC, cfg, Plan.grid(SPEC.n_layer, 4, 1), corpus) as cl:
        with pytest.raises(Exception, match="names 2 stages, the pipeline has 4"):
            cl.run(1)


def test_each_stage_times_its_compute_in_cpu_time_too(corpus):
    """A step's compute in the stage thread's CPU time beside its wall time (what the compute
    took with a core to itself): measured with one torch thread, never more than the wall time."""
    with LocalCluster(SPEC, CFG, Plan.grid(SPEC.n_layer, 2, 1), corpus) as cl:
        cl.run(2)
        for r in cl.last_results.values():
            assert 0 < r.compute_cpu_s <= r.compute_s * 1.01 + 1e-4


def test_uneven_stages_and_uneven_batch_split(corpus):
    spec = dataclasses.replace(SPEC, n_layer=5)
    cfg = dataclasses.replace(CFG, global_batch_seqs=14, micro_batches=3)  # 14 = 7 + 7, 7 = 2 + 2 + 3
    ref_losses, ref = reference(spec, cfg, corpus, 3)
    plan = Plan.grid(5, 3, 2, weights=[1, 3, 1])
    assert plan.layer_ranges == ((0, 1), (1, 4), (4, 5))
    with LocalCluster(spec, cfg, plan, corpus) as cl:
        assert_matches(cl.run(3), gathered_params(cl), ref_losses, ref)


def test_tied_head_across_stages(corpus):
    spec = dataclasses.replace(SPEC, tied_head=True)
    ref_losses, ref = reference(spec, CFG, corpus, 3)
    with LocalCluster(spec, CFG, Plan.grid(4, 2, 2), corpus) as cl:
        losses = cl.run(3)
        assert_matches(losses, gathered_params(cl), ref_losses, ref)
        last = cl.states[cl.plan.pipeline(0)[-1]].params["wte.weight"]
        assert torch.equal(last, cl.states[cl.plan.pipeline(0)[0]].params["wte.weight"])


def test_half_precision_wire_stays_close(corpus):
    ref_losses, _ = reference(SPEC, CFG, corpus)
    for wire in ("float16", "bfloat16"):
        cfg = dataclasses.replace(CFG, wire_dtype=wire)
        with LocalCluster(SPEC, cfg, Plan.grid(4, 2, 1), corpus) as cl:
            losses = cl.run(2)
        assert losses[0] == pytest.approx(ref_losses[0], rel=1e-2)
        assert losses[0] != ref_losses[0]  # the activations really travelled in half precision


def test_elastic_dp_change_keeps_single_process_result(corpus):
    """D goes 2 -> 1 -> 3 between steps; the global batch is re-split, the result unchanged."""
    ref_losses, ref = reference(SPEC, CFG, corpus)
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2, prefix="a"), corpus) as cl:
        losses = cl.run(2)
        cl.reconfigure(Plan.grid(4, 2, 1, prefix="a"))
        losses += cl.run(1)
        cl.reconfigure(Plan.grid(4, 2, 3, prefix="a"))  # a1.*, a2.* fetch their stage by transfer
        losses += cl.run(2)
        assert_matches(losses, gathered_params(cl), ref_losses, ref)


def test_restage_moves_layers_between_peers(corpus):
    """Stage boundaries move (2 even stages -> 3 uneven); new stages are assembled from transfers."""
    ref_losses, ref = reference(SPEC, CFG, corpus)
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 1, prefix="b"), corpus) as cl:
        losses = cl.run(2)
        cl.reconfigure(Plan.grid(4, 3, 1, weights=[2, 1, 1], prefix="c"))
        losses += cl.run(3)
        assert_matches(losses, gathered_params(cl), ref_losses, ref)


def test_checkpoint_resume_equals_not_stopping(corpus, tmp_path):
    ref_losses, ref = reference(SPEC, CFG, corpus)
    plan = Plan.grid(4, 2, 2)
    with LocalCluster(SPEC, CFG, plan, corpus) as cl:
        losses = cl.run(3)
        for peer in plan.pipeline(0):
            save_checkpoint(tmp_path, cl.states[peer], keep=2)
    states = {}
    for d in range(plan.dp):
        for s, peer in enumerate(plan.pipeline(d)):
            (path,) = list_checkpoints(tmp_path, plan.layer_ranges[s])
            states[peer] = load_checkpoint(path)
            assert states[peer].step == 3
    with LocalCluster(SPEC, CFG, plan, corpus, states=states) as cl:
        losses += cl.run(2)
        assert_matches(losses, gathered_params(cl), ref_losses, ref)


def test_failed_step_changes_nothing_and_retry_in_new_epoch_matches(corpus, monkeypatch):
    """A peer fails mid-step: no stage updates; the step is retried under a new epoch."""
    from dtfm.train import CommError, InMemoryComm

    ref_losses, ref = reference(SPEC, CFG, corpus)
    real_isend = InMemoryComm.isend
    fired = []

    def flaky_isend(self, peer, tag, tensor):
        if self.me == "peer0.0" and tag == "0.2/act/1" and not fired:
            fired.append(tag)
            raise CommError("link to peer0.1 went down")
        return real_isend(self, peer, tag, tensor)

    monkeypatch.setattr(InMemoryComm, "isend", flaky_isend)
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2), corpus) as cl:
        losses = cl.run(2)
        before = {p: {n: t.detach().clone() for n, t in st.params.items()} for p, st in cl.states.items()}
        with pytest.raises(CommError, match="went down"):
            cl.step()
        assert fired and cl.step_index == 2
        for p, st in cl.states.items():
            assert all(torch.equal(t, before[p][n]) for n, t in st.params.items())
        cl.reconfigure(Plan.grid(4, 2, 2, epoch=1))
        losses += cl.run(3)
        assert_matches(losses, gathered_params(cl), ref_losses, ref)


def test_oracle_holds_over_uneven_emulated_links(corpus):
    """Delays change when messages arrive, never the result."""
    from dtfm.train import Link

    def link(src, dst):  # pipeline 1 sits behind a slower, longer link
        slow = "peer1" in f"{src}{dst}"
        return Link(latency_s=0.004 if slow else 0.0005, bandwidth_bytes_per_s=2e8 if slow else 2e9)

    ref_losses, ref = reference(SPEC, CFG, corpus)
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2), corpus, link=link) as cl:
        losses = cl.run(2)
    assert losses == pytest.approx(ref_losses[:2], rel=RTOL)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.lists(st.integers(1, 4), min_size=4, max_size=4),
       st.sampled_from(["float32", "float32", "bfloat16"]))
def test_any_shape_matches_single_process(corpus, stages, dp, micro, weights, wire):
    """Random S, D, M and stage sizes: always the single-process losses (exactly so in fp32)."""
    cfg = dataclasses.replace(CFG, global_batch_seqs=12, micro_batches=micro, wire_dtype=wire)
    ref_losses, _ = reference(SPEC, dataclasses.replace(cfg, micro_batches=1, wire_dtype="float32"), corpus, 2)
    with LocalCluster(SPEC, cfg, Plan.grid(4, stages, dp, weights=weights[:stages]), corpus) as cl:
        losses = cl.run(2)
    rtol = RTOL if wire == "float32" or stages == 1 else 1e-2
    assert losses == pytest.approx(ref_losses, rel=rtol)
