"""The same oracle on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from dtfm.train import GPTSpec, LocalCluster, Plan, TrainConfig, load_corpus, reference_state, reference_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pipeline_on_gpu_matches_cpu_reference():
    spec = GPTSpec("g", n_layer=4, n_embd=64, n_head=4, seq_len=32)
    cfg = TrainConfig(global_batch_seqs=8, micro_batches=2, lr=1e-3)
    corpus = load_corpus(max_bytes=256 << 10)
    ref = reference_state(spec, cfg)
    want = [reference_step(ref, corpus) for _ in range(3)]
    torch.backends.cuda.matmul.allow_tf32 = False
    with LocalCluster(spec, cfg, Plan.grid(4, 2, 2), corpus, device="cuda") as cl:
        got = cl.run(3)
        assert next(iter(cl.states.values())).device.type == "cuda"
    assert got == pytest.approx(want, rel=1e-4)
