"""bf16 mixed precision and host staging, on the CPU (tests/train/test_train_gpu.py runs both on a GPU).

fp32 takes no autocast at all (the oracle tests pin its bits); bf16 keeps float32 master weights,
gradients and AdamW moments while the matrix products run in bfloat16, and pipeline + DP training
under bf16 follows single-process bf16 training closely (not bit for bit: the micro-batch shapes
change the bf16 rounding). On a CPU the host staging is the plain path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtfm.train import (GPTSpec, HostStaging, InMemoryHub, LocalCluster, Plan, TrainConfig, autocast, load_corpus,
                        reference_state, reference_step)

SPEC = GPTSpec("prec", n_layer=2, n_embd=32, n_head=4, seq_len=16)
CFG = TrainConfig(global_batch_seqs=8, micro_batches=2, lr=3e-3, comm_timeout_s=20.0)
BF16 = dataclasses.replace(CFG, precision="bf16")


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=64 << 10)


def test_fp32_enters_no_autocast_and_bf16_runs_matmuls_in_bfloat16():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with autocast("fp32", "cpu"):
        assert lin(x).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    with autocast("bf16", torch.device("cpu")):
        assert lin(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown precision"):
        autocast("fp8", "cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(precision="fp16")


def test_bf16_keeps_fp32_master_weights_and_moments_and_follows_fp32(corpus):
    ref32, ref16 = reference_state(SPEC, CFG), reference_state(SPEC, BF16)
    l32 = [reference_step(ref32, corpus) for _ in range(4)]
    l16 = [reference_step(ref16, corpus) for _ in range(4)]
    assert all(p.dtype == torch.float32 for p in ref16.params.values())
    assert all(t.dtype == torch.float32 for t in ref16.optim.state_tensors().values())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in ref16.params.values())
    assert l16 != l32  # bf16 arithmetic did run
    assert l16 == pytest.approx(l32, rel=2e-2)


def test_bf16_pipeline_and_dp_follow_single_process_bf16(corpus):
    ref = reference_state(SPEC, BF16)
    want = [reference_step(ref, corpus) for _ in range(3)]
    with LocalCluster(SPEC, BF16, Plan.grid(SPEC.n_layer, 2, 2), corpus) as cl:
        got = cl.run(3)
        a, b = (cl.states[p] for p in cl.plan.pipeline(0)[:1] + cl.plan.pipeline(1)[:1])
        assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)  # DP replicas stay identical
    assert got == pytest.approx(want, rel=1e-2)


def test_host_staging_on_a_cpu_is_the_plain_path():
    hub = InMemoryHub()
    a, b = hub.endpoint("a"), hub.endpoint("b")
    staging = HostStaging("cpu")
    assert not staging.enabled and not HostStaging("cuda", plain=True).enabled
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    staging.send(a, "b", "x", t).wait(1.0)
    got = b.recv("a", "x", 1.0)
    assert torch.equal(got, t)
    assert staging.to_device(got.to(torch.bfloat16), torch.float32).dtype == torch.float32
    assert staging.bytes_down == staging.bytes_up == 0
    staging.close()
