"""Training on a CUDA device (every test skipped without one; `pytest -m gpu` selects them).

The oracle on the GPU (fp32 with TF32 off: pipeline + DP equals one process within 1e-4), bf16
mixed precision there, the codecs on the device (the same payload bytes as on a CPU, decoded to
the same bits), host staging through pinned buffers, a stage's checkpoint and hand-over landing
on the GPU, and the codec speed measured there. bench/gpu.py runs these and the longer checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtfm.train import (GPTSpec, HostStaging, InMemoryHub, LocalCluster, Plan, StageState, TrainConfig, TransferReceiver,
                        encode_transfer, get_compression, load_checkpoint, load_corpus, reference_state, reference_step,
                        save_checkpoint, stage_tensors)
from dtfm.train.compress import measure_compress_cost
from dtfm.train.compress.codec import decode_dense, decode_sparse, encode_dense, encode_sparse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPEC = GPTSpec("g", n_layer=4, n_embd=64, n_head=4, seq_len=32)
CFG = TrainConfig(global_batch_seqs=8, micro_batches=2, lr=1e-3)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=256 << 10)


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _params(cl: LocalCluster) -> dict[str, torch.Tensor]:
    out = {}
    for peer in cl.plan.pipeline(0):
        out.update({n: p.detach().cpu() for n, p in cl.states[peer].params.items()})
    return out


def test_pipeline_on_gpu_matches_cpu_reference(corpus):
    ref = reference_state(SPEC, CFG)
    want = [reference_step(ref, corpus) for _ in range(3)]
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2), corpus, device="cuda") as cl:
        got = cl.run(3)
        assert next(iter(cl.states.values())).device.type == "cuda"
    assert got == pytest.approx(want, rel=1e-4)


def test_fp32_pipeline_on_gpu_equals_one_process_on_gpu(corpus):
    ref = StageState(SPEC, CFG, (0, SPEC.n_layer), "cuda")
    want = [reference_step(ref, corpus) for _ in range(5)]
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2), corpus, device="cuda") as cl:
        got = cl.run(5)
        params = _params(cl)
        staged = sum(st.staging.bytes_down for st in cl.states.values())
    assert got == pytest.approx(want, rel=1e-4)
    for n, p in ref.params.items():  # per tensor, relative L2 (as tests/train/test_train_oracle.py)
        want_p = p.detach().cpu()
        assert float((params[n] - want_p).norm()) <= 1e-4 * float(want_p.norm()) + 1e-8, n
    assert staged > 0  # the boundary tensors went through the pinned buffers


def test_bf16_on_gpu_keeps_fp32_masters_and_follows_one_process(corpus):
    cfg = dataclasses.replace(CFG, precision="bf16")
    ref = StageState(SPEC, cfg, (0, SPEC.n_layer), "cuda")
    want = [reference_step(ref, corpus) for _ in range(5)]
    with LocalCluster(SPEC, cfg, Plan.grid(4, 2, 2), corpus, device="cuda") as cl:
        got = cl.run(5)
        st = next(iter(cl.states.values()))
        assert all(p.dtype == torch.float32 for p in st.params.values())
        assert all(t.dtype == torch.float32 for t in st.optim.state_tensors().values())
    assert got == pytest.approx(want, rel=2e-2)


@pytest.mark.parametrize("method, rotate", [("int8", False), ("int4", False), ("int4", True)])
def test_dense_codec_on_gpu_makes_the_cpu_bytes_and_decodes_to_the_same_bits(method, rotate):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 100, 33, generator=g)
    x[0, 0, :4] *= 80.0
    cpu = encode_dense(x, method, 64, rotate)
    gpu = encode_dense(x.cuda(), method, 64, rotate)
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    want = decode_dense(cpu, tuple(x.shape), method, 64, rotate)
    got = decode_dense(gpu, tuple(x.shape), method, 64, rotate)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


def test_sparse_codec_decodes_to_the_same_bits_on_either_device():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=g)
    for k, bits in ((205, 4), (1024, 8), (32, 2)):
        payload = encode_sparse(x.cuda(), 1024, k, bits)
        assert payload.device.type == "cuda"
        on_gpu = decode_sparse(payload, x.numel(), 1024, k, bits)
        on_cpu = decode_sparse(payload.cpu(), x.numel(), 1024, k, bits)
        assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)
        assert torch.count_nonzero(on_cpu) <= -(-x.numel() // 1024) * k


def test_compressed_run_on_gpu_keeps_replicas_identical(corpus):
    comp = get_compression("slow-link")
    comp = dataclasses.replace(comp, inner_steps=2)
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 2), corpus, device="cuda", compression=comp) as cl:
        losses = cl.run(4)
        for s in range(2):
            a, b = (cl.states[cl.plan.pipeline(d)[s]] for d in range(2))
            assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
            assert a.compress.buffers["ef"].device.type == "cuda"
    assert all(loss == loss for loss in losses)


def test_host_staging_round_trips_through_pinned_buffers():
    hub = InMemoryHub()
    a, b = hub.endpoint("a"), hub.endpoint("b")
    staging = HostStaging("cuda")
    t = torch.randn(4, 256, 64, device="cuda")
    handles = [staging.send(a, "b", f"x{i}", t * i) for i in range(3)]  # returns before the copies are done
    for h in handles:
        h.wait(10.0)
    for i in range(3):
        got = b.recv("a", f"x{i}", 10.0)
        assert got.device.type == "cpu" and torch.equal(got, (t * i).cpu())
        up = staging.to_device(got.to(torch.bfloat16), torch.float32)
        assert up.device.type == "cuda" and up.dtype == torch.float32
        assert torch.equal(up, (t * i).to(torch.bfloat16).float())
    assert staging.bytes_down == 3 * t.numel() * 4 and staging.bytes_up == 3 * t.numel() * 2
    staging.close()


def test_a_stage_saved_or_handed_over_lands_on_the_gpu(tmp_path, corpus):
    with LocalCluster(SPEC, CFG, Plan.grid(4, 2, 1), corpus, device="cuda") as cl:
        cl.run(2)
        st = cl.states[cl.plan.pipeline(0)[1]]
    path = save_checkpoint(tmp_path, st)
    back = load_checkpoint(path, "cuda")
    manifest, chunks = encode_transfer(st, 1 << 16)
    rx = TransferReceiver(manifest)
    for i, c in enumerate(chunks):
        rx.feed(i, c)
    moved = rx.finish(SPEC, CFG, st.layer_range, "cuda")
    want = {k: v.cpu() for k, v in stage_tensors(st).items()}
    for other in (back, moved):
        assert other.device.type == "cuda" and other.step == st.step
        got = stage_tensors(other)
        assert all(torch.equal(got[k].cpu(), want[k]) for k in want)


def test_codec_speed_is_measured_on_the_gpu():
    speed = measure_compress_cost(1 << 20, 2, device="cuda")
    assert all(v >= 0 for v in speed.to_vector()) and speed.int8_encode_ns_per_elem > 0


def test_a_stage_on_the_gpu_turns_tf32_off():
    """fp32 on a GPU is IEEE fp32, whatever the process set before: a daemon's stage must not
    differ from one process (with TF32 off) by TF32's rounding."""
    torch.backends.cuda.matmul.allow_tf32 = True
    StageState(SPEC, CFG, (0, 1), "cuda")
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
