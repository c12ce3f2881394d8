"""Every device check of issue 31 in one run, for a machine with one CUDA GPU (an H200 here).

    python bench/gpu.py                   # stops at the first failed check, exit 1 with its reason
    python bench/gpu.py --keep-going      # runs every check, reports every failure
    python bench/gpu.py --device cpu --quick --keep-going    # the same code paths, tiny sizes, on a CPU

Each check runs in its own child process (`--run-check NAME`) under its own time bound, all of
them inside a total bound (`--total-s`, 470 s: the device lends minutes), cheapest and most
telling first. A check appends its figures as JSON lines while it runs, so what it measured
before a timeout survives; after every check the merged results are written to
`$OUT/gpu.json` (a temporary folder when OUT is unset), the children's output to
`$OUT/checks.log`, the daemons' logs to `$OUT/daemons.log`, and the last line printed is one
JSON object: the results and the failures.

    pytest     `pytest -m gpu`: the GPU tests (tests/train/test_train_gpu.py and the other gpu-marked ones)
    codecs     int8/int4(+Hadamard)/sparse coding GB/s on the GPU against this CPU's figures and the
               scheduler's reference; the daemon's probe (`measure_codec_ns`) on the device
    mfu        one stage of gpt3-xl (3 of its 24 layers: 8 stages; the preset's micro-batch of one
               2048-token sequence) forward + backward in bf16: tokens/s and MFU against 989 TFLOP/s
    staging    host-staged transfers device -> wire -> device against plain copies, their overlap
               with compute, and a 2-stage `small` pipeline's idle time waiting for them
    precision  fp32 (TF32 off) 2 x 2 LocalCluster against one process on the GPU (1e-4), bf16
               against fp32 over 200 steps of `tiny`
    daemons    4 daemons with --device cuda train `small` 2 x 2 (--dp 2, kept through the
               reconfigurations), a follower SIGKILLed and restarted (its stage fetched onto the
               GPU): the first 20 losses against one process on the GPU (fp32, 1e-4), every
               checkpoint (each 10 steps) joined and its next 10 steps replayed in one process
               (1e-4), replicas identical; the swarm's tokens/s against one process; how late
               each daemon's event loop ran and where it stalled (DTFM_GPU_PLANE_PROFILE: the
               peers' --plane-profile, default test)
    compile    the mfu stage under torch.compile (if it compiles in time)

MFU counts model FLOPs as the scheduler's cost model does (sched/spec.py: forward 2 x parameters
x tokens + 2 x seq^2 x width per layer for causal attention, backward twice the forward); the
PaLM count (non-causal attention, 4 x seq^2 x width) is given beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import common  # bench/common.py: the benchmarks' shared swarm helpers
import replay as replays  # bench/replay.py: a swarm's checkpoints replayed in one process

ROOT = Path(__file__).resolve().parent.parent
PEAK_BF16_TFLOPS = 989.0  # H200 SXM dense bf16 (the datasheet's, as the issue names it)

# name -> time bound in seconds (the quick CPU dry run uses the same bounds)
CHECKS: dict[str, float] = {
    "pytest": 150.0,
    "codecs": 50.0,
    "mfu": 60.0,
    "staging": 60.0,
    "precision": 90.0,
    "daemons": 240.0,
    "compile": 90.0,
}
OPTIONAL = {"compile"}
GRACE_S = 20.0  # after a check's bound: SIGTERM, this long to clean up, then SIGKILL  # a failure here is reported, not counted


# ---------------------------------------------------------------------------------- helpers


def _emit(path: Path, **figures: object) -> None:
    """Append figures to the check's result file (one JSON object per line)."""
    with open(path, "a") as f:
        f.write(json.dumps(figures) + "\n")
    print(json.dumps(figures), flush=True)


def _no_tf32() -> None:
    import torch

    with warnings.catch_warnings():  # (newer torch warns that this setting's API will change)
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up, synchronised."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# ---------------------------------------------------------------------------------- checks


def check_pytest(out: Path, device: str, quick: bool) -> None:
    # the files that hold gpu-marked tests (collecting the whole suite costs time and imports the world)
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in f.read_text())
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rs",
           "--durations=8", *files]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(tail[-60:]), flush=True)
    summary = next((line for line in reversed(tail) if " passed" in line or " failed" in line or " error" in line
                    or " skipped" in line), "")
    _emit(out, pytest_rc=proc.returncode, pytest_summary=summary, pytest_s=round(time.monotonic() - t0, 1))
    if proc.returncode != 0:
        raise RuntimeError(f"pytest -m gpu failed: {summary}")
    if device == "cuda" and "skipped" in summary and "passed" not in summary:
        raise RuntimeError(f"pytest -m gpu ran nothing on the GPU: {summary}")


def check_codecs(out: Path, device: str, quick: bool) -> None:
    import torch

    from dtfm.peer.services import measure_codec_ns
    from dtfm.sched import REFERENCE_CODEC_SPEED
    from dtfm.train.compress import measure_compress_cost

    def gbs(speed) -> dict:  # ns per float32 element -> GB/s of float32 input
        return {k.replace("_ns_per_elem", ""): (round(4.0 / v, 2) if v > 0 else None)
                for k, v in speed.__dict__.items()}

    torch.set_num_threads(1)
    n_cpu = 1 << (18 if quick else 22)
    cpu = measure_compress_cost(n_cpu, 2)
    _emit(out, codec_cpu_1thread_gbs=gbs(cpu), codec_reference_gbs=gbs(REFERENCE_CODEC_SPEED), codec_cpu_elements=n_cpu)
    if device == "cpu":
        return
    for n in ((1 << 20,) if quick else (1 << 22, 1 << 25)):
        dev = measure_compress_cost(n, 3, device=device)
        _emit(out, **{f"codec_gpu_gbs_{n}": gbs(dev)})
    probe = measure_codec_ns(1, device)  # what a daemon with --device cuda gossips: the same 7-vector
    _emit(out, daemon_probe_ns_per_elem=[round(v, 5) for v in probe], daemon_probe_len=len(probe))
    # the ceiling: a device-to-device copy of the same float32 bytes
    x = torch.randn(1 << 25, device=device)
    y = torch.empty_like(x)
    s = _timed(lambda: y.copy_(x), device, 10)
    _emit(out, copy_gbs_read_plus_write=round(2 * x.numel() * 4 / s / 1e9, 1))


def _flops(spec, layers: int, tokens: int, seq: int, head: bool) -> tuple[float, float]:
    """(scheduler-count, PaLM-count) model FLOPs of forward + backward for `layers` blocks."""
    c = spec.n_embd
    dense = 2 * spec.layer_params * tokens * layers + (2 * c * spec.vocab * tokens if head else 0)
    causal = 2 * tokens * seq * c * layers
    return 3 * (dense + causal), 3 * (dense + 2 * causal)


def _mfu_stage(out: Path, device: str, quick: bool, compiled: bool) -> None:
    import torch

    from dtfm.train import GPTSpec, GPTStage, autocast, get_preset

    spec = get_preset("gpt3-xl") if not quick else GPTSpec("q", n_layer=8, n_embd=64, n_head=4, seq_len=64, vocab=256)
    per = spec.n_layer // 8
    seq, mb = spec.seq_len, 1  # the scheduler's gpt3-xl micro-batch: one sequence (sched/spec.py)
    for which, rng in (("middle", (3 * per, 4 * per)), ("last", (7 * per, 8 * per))):
        if compiled and which == "last":
            break
        t_build = time.perf_counter()
        stage = GPTStage(spec, rng, seed=0).to(device)
        run = torch.compile(stage) if compiled else stage
        x = torch.randn(mb, seq, spec.n_embd, device=device, requires_grad=True)
        y = torch.randint(0, spec.vocab, (mb, seq), device=device)
        g = torch.randn(mb, seq, spec.n_embd, device=device)

        def step():
            with autocast("bf16", device):
                o = run(x, y) if stage.is_last else run(x)
            o.backward() if stage.is_last else o.backward(g)

        for _ in range(3):  # warm-up (and, compiled, the compilation)
            step()
        _sync(device)
        warm_s = time.perf_counter() - t_build
        iters = 3 if quick else 20
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            torch.cuda.synchronize()
            s = start.elapsed_time(end) / 1e3 / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            s = (time.perf_counter() - t0) / iters
        ours, palm = _flops(spec, rng[1] - rng[0], mb * seq, seq, head=stage.is_last)
        tag = ("compiled_" if compiled else "") + which
        _emit(out, **{f"mfu_{tag}": {
            "layers": list(rng), "tokens": mb * seq, "step_ms": round(s * 1e3, 3),
            "tokens_per_s": round(mb * seq / s), "tflops": round(ours / s / 1e12, 1),
            "mfu": round(ours / s / 1e12 / PEAK_BF16_TFLOPS, 4), "mfu_palm": round(palm / s / 1e12 / PEAK_BF16_TFLOPS, 4),
            "warmup_s": round(warm_s, 1),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None}})
        del stage, run, x, y, g
        if device == "cuda":
            torch.cuda.empty_cache()


def check_mfu(out: Path, device: str, quick: bool) -> None:
    import torch

    if device == "cuda":
        torch.backends.cuda.enable_flash_sdp(True)
    _mfu_stage(out, device, quick, compiled=False)


def check_compile(out: Path, device: str, quick: bool) -> None:
    _mfu_stage(out, device, quick, compiled=True)


def check_staging(out: Path, device: str, quick: bool) -> None:
    import torch

    from dtfm.train import HostStaging, InMemoryHub, LocalCluster, Plan, TrainConfig, get_preset, load_corpus

    hub = InMemoryHub(capacity=256)
    a, b = hub.endpoint("a"), hub.endpoint("b")
    n = 8 if quick else 40
    shapes = {"small_act_fp32": ((4, 256, 768), torch.float32), "xl_act_bf16": ((1, 2048, 2048), torch.bfloat16)}
    if quick:
        shapes = {"quick": ((2, 64, 64), torch.float32)}
    for name, (shape, dtype) in shapes.items():
        t = torch.randn(shape, device=device).to(dtype)
        nbytes = t.numel() * t.element_size()
        row: dict = {"bytes": nbytes}
        for mode in ("plain", "staged"):
            st = HostStaging(device, plain=mode == "plain")

            def streamed(st=st):  # n sends in flight, then n receives uploaded
                hs = [st.send(a, "b", f"s{i}", t) for i in range(n)]
                for i in range(n):
                    st.to_device(b.recv("a", f"s{i}", 30.0), dtype)
                for h in hs:
                    h.wait(30.0)

            def serial(st=st):  # one at a time: the latency path
                for i in range(n):
                    st.send(a, "b", f"r{i}", t).wait(30.0)
                    st.to_device(b.recv("a", f"r{i}", 30.0), dtype)

            row[f"{mode}_streamed_gbs"] = round(n * nbytes / _timed(streamed, device, 3) / 1e9, 2)
            row[f"{mode}_serial_gbs"] = round(n * nbytes / _timed(serial, device, 3) / 1e9, 2)
            # overlap: a stage computes micro-batches and sends each output as it is made
            w = torch.randn(2048, 2048, device=device)

            def compute_and_send(st=st, send=True):
                h = []
                for i in range(n):
                    z = t.float().reshape(-1, t.shape[-1])[:, :1].expand(-1, 2048)[:1024] @ w
                    for _ in range(4):
                        z = z @ w
                    if send:
                        h.append(st.send(a, "b", f"o{i}", t + z[0, 0]))
                for x in h:
                    x.wait(30.0)
                if send:
                    for i in range(n):
                        b.recv("a", f"o{i}", 30.0)

            row[f"{mode}_compute_and_send_s"] = round(_timed(compute_and_send, device, 3), 4)
            if mode == "plain":
                row["compute_only_s"] = round(_timed(lambda: compute_and_send(send=False), device, 3), 4)
            st.close()
        _emit(out, **{f"transfer_{name}": row})
    # a 2-stage pipeline of `small` (tiny when quick): step time and the stages' wait for tensors
    spec = get_preset("tiny" if quick else "small")
    cfg = TrainConfig(global_batch_seqs=16, micro_batches=8)
    corpus = load_corpus(max_bytes=1 << 20)
    res: dict = {}
    for mode in ("plain", "staged"):
        with LocalCluster(spec, cfg, Plan.grid(spec.n_layer, 2, 1), corpus, device=device) as cl:
            if mode == "plain":
                for s in cl.states.values():
                    s.staging = HostStaging(device, plain=True)
            cl.run(2)
            steps, waits = [], []
            for _ in range(3 if quick else 6):
                _sync(device)
                t0 = time.perf_counter()
                cl.step()
                _sync(device)
                steps.append(time.perf_counter() - t0)
                waits.append([round(r.wait_s, 4) for r in cl.last_results.values()])
            res[mode] = {"step_s": round(statistics.median(steps), 4), "wait_s_per_stage": waits[-1],
                         "tokens_per_s": round(cfg.global_batch_seqs * spec.seq_len / statistics.median(steps))}
    _emit(out, pipeline_small_2x1=res)


def check_precision(out: Path, device: str, quick: bool) -> None:
    import dataclasses

    import torch

    from dtfm.train import LocalCluster, Plan, StageState, TrainConfig, get_preset, load_corpus, reference_step

    _no_tf32()
    spec = get_preset("tiny")
    cfg = TrainConfig(global_batch_seqs=16, micro_batches=4)
    corpus = load_corpus(max_bytes=4 << 20)
    steps = 5 if quick else 20
    ref = StageState(spec, cfg, (0, spec.n_layer), device)
    want = [reference_step(ref, corpus) for _ in range(steps)]
    with LocalCluster(spec, cfg, Plan.grid(spec.n_layer, 2, 2), corpus, device=device) as cl:
        got = cl.run(steps)
        params = {}
        for peer in cl.plan.pipeline(0):
            params.update({n: p.detach().float().cpu() for n, p in cl.states[peer].params.items()})
    loss_dev = max(_rel(g, w) for g, w in zip(got, want))
    num = sum(float((params[n] - p.detach().cpu()).pow(2).sum()) for n, p in ref.params.items())
    den = sum(float(p.detach().cpu().pow(2).sum()) for p in ref.params.values())
    param_dev = (num / den) ** 0.5
    _emit(out, fp32_cluster_vs_one_process={"steps": steps, "max_rel_loss": loss_dev, "rel_param_l2": param_dev,
                                            "ok": loss_dev <= 1e-4 and param_dev <= 1e-4})
    if not (loss_dev <= 1e-4 and param_dev <= 1e-4):
        raise RuntimeError(f"fp32 2x2 on {device} differs from one process: loss {loss_dev:.2e}, params {param_dev:.2e}")
    # the same for `small` (what the daemons train), 30 steps, the deviation per step: how far the
    # GPU's fp32 arithmetic drifts when the micro-batch shapes (hence the GEMM kernels) differ
    if not quick:
        sm = get_preset("small")
        one = StageState(sm, cfg, (0, sm.n_layer), device)
        w_sm = [reference_step(one, corpus) for _ in range(30)]
        with LocalCluster(sm, cfg, Plan.grid(sm.n_layer, 2, 2), corpus, device=device) as cl:
            g_sm = cl.run(30)
        _emit(out, fp32_small_2x2_vs_one_process={"rel_loss_per_step": [float(f"{_rel(g, w):.2e}")
                                                                         for g, w in zip(g_sm, w_sm)]})
        del one
    # bf16 against fp32, one process each, 200 steps of tiny
    n = 6 if quick else 200
    r32 = StageState(spec, cfg, (0, spec.n_layer), device)
    r16 = StageState(spec, dataclasses.replace(cfg, precision="bf16"), (0, spec.n_layer), device)
    t0 = time.perf_counter()
    l32 = [reference_step(r32, corpus) for _ in range(n)]
    t32 = time.perf_counter() - t0
    t0 = time.perf_counter()
    l16 = [reference_step(r16, corpus) for _ in range(n)]
    t16 = time.perf_counter() - t0
    dev = [abs(x - y) for x, y in zip(l16, l32)]
    tail = max(1, n // 10)
    num = sum(float((r16.params[k] - p).detach().double().pow(2).sum()) for k, p in r32.params.items())
    den = sum(float(p.detach().double().pow(2).sum()) for p in r32.params.values())
    _emit(out, bf16_vs_fp32_tiny={
        "steps": n, "max_abs_loss_dev": round(max(dev), 5), "max_rel_loss_dev": round(max(d / y for d, y in zip(dev, l32)), 5),
        "mean_last_tenth_fp32": round(statistics.mean(l32[-tail:]), 5),
        "mean_last_tenth_bf16": round(statistics.mean(l16[-tail:]), 5),
        "rel_param_l2_after": round((num / den) ** 0.5, 5), "fp32_s": round(t32, 2), "bf16_s": round(t16, 2),
        "first_loss": round(l32[0], 4), "last_loss_fp32": round(l32[-1], 4), "last_loss_bf16": round(l16[-1], 4)})
    if not all(x == x for x in l16):
        raise RuntimeError("bf16 training produced a NaN loss")
    # bf16 across the 2 x 2 cluster against bf16 in one process
    c16 = dataclasses.replace(cfg, precision="bf16")
    r = StageState(spec, c16, (0, spec.n_layer), device)
    w16 = [reference_step(r, corpus) for _ in range(steps)]
    with LocalCluster(spec, c16, Plan.grid(spec.n_layer, 2, 2), corpus, device=device) as cl:
        g16 = cl.run(steps)
    _emit(out, bf16_cluster_vs_one_process={"steps": steps, "max_rel_loss": max(_rel(g, w) for g, w in zip(g16, w16))})
    del torch


def check_daemons(out: Path, device: str, quick: bool) -> None:
    """4 daemons train 2 x 2 until a follower was killed, restarted and placed again with a
    fetched stage, and at least `min_steps` steps are logged; then the operator stops the run and
    every logged step is compared with one process on the same device."""
    from dtfm.swarm import cli as swarm
    from dtfm.swarm.proc import peer_request, peer_status
    from dtfm.swarm.state import load_state
    from dtfm.swarm.train import operator_op, stop_training, sync_logs
    from dtfm.train import LocalCluster, Plan, StageState, TrainConfig, get_preset, load_corpus, reference_step

    _no_tf32()
    preset = "tiny" if quick else "small"
    min_steps = 10 if quick else 20
    spec, cfg = get_preset(preset), TrainConfig(seed=0)  # what `train start` runs without knobs
    tmp = Path(tempfile.mkdtemp(prefix="dtfm-gpu-"))
    run_dir = tmp / "s"

    def trainings(state) -> dict:
        return {p.name: ((peer_status(p) or {}).get("training") or {}) for p in state.peers if p.alive()}

    wait_for = functools.partial(common.wait_for, interval_s=0.5)  # (the daemons' status, polled)

    def rows() -> list[dict]:
        return sync_logs(run_dir, load_state(run_dir))[0]  # every peer's log, merged

    def gpu_pids() -> list[int]:
        if device != "cuda":
            return []
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                           capture_output=True, text=True)
        return sorted(int(x) for x in q.stdout.split() if x.strip().isdigit())

    t_up = time.monotonic()
    try:
        profile = os.environ.get("DTFM_GPU_PLANE_PROFILE", "test")  # (the scripted swarm's default)
        rc = swarm.main(["up", "--run-dir", str(run_dir), "--peers", "4", "--no-emulation", "--device", device,
                         "--timeout", "90", "--plane-profile", profile])
        if rc != 0:
            raise RuntimeError(f"dtfm-swarm up exited {rc}")
        _emit(out, daemons_up_s=round(time.monotonic() - t_up, 1), plane_profile=profile)
        # (micro-batches fixed at TrainConfig's 4: the first epoch is compared with the same 2 x 2 in one
        # process; checkpoints every 10 steps: each is replayed in one process, the oracle past the first 20)
        if swarm.main(["train", "--run-dir", str(run_dir), "--preset", preset, "--stages", "2", "--dp", "2",
                       "--micro-batches", str(cfg.micro_batches), "--checkpoint-every", "10", "--steps", "1000"]) != 0:
            raise RuntimeError("dtfm-swarm train failed")
        state = load_state(run_dir)
        before = wait_for("6 steps logged", lambda: len(r := rows()) >= 6 and r, 120)
        tps = [r["tokens_per_s"] for r in before[2:6] if r.get("tokens_per_s")]
        pids = gpu_pids()
        t = trainings(state)
        coord = next((n for n, v in t.items() if v.get("role") == "coordinator"), None)
        victim = next(p for p in state.peers[1:] if p.alive() and t[p.name].get("stage") is not None
                      and p.name != coord)
        _emit(out, swarm_before_kill={"swarm_tokens_per_s": round(statistics.median(tps)) if tps else None,
                                      "gpu_processes": len(pids), "daemons_on_gpu": sum(
                                          p.pid in pids for p in state.peers) if device == "cuda" else None,
                                      "victim": victim.name, "victim_stage": t[victim.name].get("stage"),
                                      "coordinator": coord, "steps_logged": len(before)})
        epoch0 = t[victim.name].get("epoch", 0)
        if os.environ.get("DTFM_GPU_NO_KILL") == "1":  # exactness only: no kill, one 2 x 2 epoch throughout
            wait_for(f"{min_steps} steps", lambda: len(rows()) >= min_steps, 120)
            return _compare_daemons(out, device, run_dir, state, trainings, wait_for, rows, spec, cfg, min_steps)
        killed = time.monotonic()
        swarm.main(["kill", victim.name, "--run-dir", str(run_dir)])
        n_before = len(rows())
        wait_for("training again after the kill", lambda: len(rows()) >= n_before + 2, 120)
        resumed_s = time.monotonic() - killed
        swarm.main(["restart", victim.name, "--run-dir", str(run_dir)])
        state = load_state(run_dir)
        peer = next(p for p in state.peers if p.name == victim.name)

        def placed_again():
            v = (peer_status(peer) or {}).get("training") or {}
            return (v.get("state") == "training" and v.get("epoch", 0) > epoch0 and v.get("fetched_bytes", 0) > 0
                    and v)
        nudged = False
        try:
            again = wait_for(f"{victim.name} to train a fetched stage again", placed_again, 25)
        except RuntimeError:  # the coordinator keeps a working allocation: the operator asks for a new one
            nudged = True
            c = wait_for("a coordinator", lambda: next(
                (p for p in state.peers if p.alive() and trainings(state).get(p.name, {}).get("role") == "coordinator"),
                None), 30)
            peer_request(c, "train_reschedule", {"op": operator_op(run_dir, c, "reschedule").to_wire()}, timeout_s=30.0)
            again = wait_for(f"{victim.name} to train a fetched stage again (rescheduled)", placed_again, 90)
        replaced = {"fetched_bytes": again.get("fetched_bytes"), "stage": again.get("stage"), "rescheduled": nudged,
                    "after_restart_s": round(time.monotonic() - killed - resumed_s, 1),
                    "on_gpu": peer.pid in gpu_pids() if device == "cuda" else None}
        _emit(out, kill_and_restart={"resumed_after_kill_s": round(resumed_s, 1), "restarted": replaced})
        n_placed = len(rows())
        # a checkpoint of the epoch that placed it, and the 10 steps after it (what its replay compares)
        need = max(min_steps, -(-n_placed // 10) * 10 + 11)
        wait_for(f"{need} steps: a checkpoint after the restart and 10 more",
                 lambda: len(rows()) >= need, 120)
        _compare_daemons(out, device, run_dir, state, trainings, wait_for, rows, spec, cfg, min_steps)
    finally:
        try:  # how late each daemon's event loop ran, and where it stalled (peer/loopwatch.py)
            _emit(out, event_loops={p.name: (peer_status(p) or {}).get("loop") for p in load_state(run_dir).peers
                                    if p.alive()})
        except Exception as e:  # (the swarm may not have come up)
            print(f"no event-loop figures: {type(e).__name__}: {e}")
        swarm.main(["down", "--run-dir", str(run_dir), "--kill"])
        keep = Path(os.environ["OUT"]) / "daemons.log" if os.environ.get("OUT") else None
        for log in sorted(run_dir.glob("p*/daemon.log")):  # the end of each daemon's log, for the record
            text = log.read_text(errors="replace")
            print(f"---- {log}", "\n".join(text.splitlines()[-12:]), sep="\n")
            stalls = [line for line in text.splitlines() if "event loop stalled" in line]
            print(f"{len(stalls)} event-loop stalls logged", *stalls[-5:], sep="\n")
            if keep is not None:  # every daemon's log (the last 3 MB of each) in one file beside gpu.json
                with open(keep, "a") as f:
                    f.write(f"==== {log.parent.name}\n{text[-3_000_000:]}\n")
        subprocess.run(["rm", "-rf", str(tmp)])


def _compare_daemons(out, device, run_dir, state, trainings, wait_for, rows, spec, cfg, min_steps) -> None:
    """Stop the run, then compare every logged step with one process on the same device, the
    first epoch with the same 2 x 2 in one process, and the stages' replicas with each other."""
    from dtfm.swarm.train import stop_training
    from dtfm.train import LocalCluster, Plan, StageState, load_corpus, reference_step

    coord = wait_for("a coordinator", lambda: next(
        (p for p in state.peers if p.alive() and trainings(state).get(p.name, {}).get("role") == "coordinator"),
        None), 30)
    stop_training(run_dir, coord)

    def ended():
        v = {n: x for n, x in trainings(state).items() if x.get("stage") is not None}
        return v and all(x.get("last_end") and x["last_end"].get("epoch") == x.get("epoch")
                         and x.get("state") not in ("training", "stopping") for x in v.values()) and v
    end = wait_for("every peer to end", ended, 60)
    groups: dict = {}
    for v in end.values():
        groups.setdefault(v["stage"], set()).add(v["last_end"]["params_sha256"])
    time.sleep(1.0)
    got = rows()  # (merged into the run dir's train.jsonl too: what the replay reads)
    # the oracle: one process on the same device, as many steps as the swarm logged
    ref = StageState(spec, cfg, (0, spec.n_layer), device)
    corpus = load_corpus()
    want, ref_s = [], []
    for _ in range(len(got)):
        _sync(device)
        t0 = time.perf_counter()
        want.append(reference_step(ref, corpus))
        _sync(device)
        ref_s.append(time.perf_counter() - t0)
    one_tps = cfg.global_batch_seqs * spec.seq_len / statistics.median(ref_s[2:] or ref_s)
    devs = [_rel(r["loss"], want[r["step"]]) for r in got if r["step"] < len(want)]
    worst = max(devs[:min_steps]) if devs else None  # the oracle: the first min_steps steps
    # Past them, float order's drift (fp32 sums in another order grow about 1.2x a step in `small`)
    # outgrows 1e-4 whatever the swarm does: each checkpoint is joined and replayed in one process
    # instead, its next 10 steps compared with the swarm's, within the same 1e-4 on a GPU (float
    # order alone moved one process's 2 x 2 by 1.4e-5 in one step on the H200) and 1e-5 on a CPU.
    rep = replays.replay(run_dir, replays.Replay(rel=1e-4 if device == "cuda" else replays.REL), max_steps=10,
                         device=device)
    replayed = rep.to_dict(got)
    # the first epoch ran 2 x 2: the same shape in one process (LocalCluster) must give its losses
    first = [r for r in got if r["epoch"] == got[0]["epoch"]]
    with LocalCluster(spec, cfg, Plan.grid(spec.n_layer, 2, 2), corpus, device=device) as cl:
        same = cl.run(len(first))
    same_dev = max(_rel(r["loss"], x) for r, x in zip(first, same))
    _emit(out, daemons_per_step={"rel_to_one_process": [float(f"{d:.2e}") for d in devs],
                                 "epoch": [r["epoch"] for r in got],
                                 "first_epoch_rel_to_local_2x2": same_dev,
                                 "local_2x2_rel_to_one_process": [float(f"{_rel(x, w):.2e}")
                                                                  for x, w in zip(same, want)]})
    result: dict = {"steps_logged": len(got), "every_step_once": [r["step"] for r in got] == list(range(len(got))),
              f"max_rel_loss_first_{min_steps}": worst, "max_rel_loss_all": max(devs) if devs else None,
              "replay": replayed, "replayed_epochs": sorted({r["epoch"] for r in got if r["step"] in rep.compared}),
              "replicas_identical": all(len(h) == 1 for h in groups.values()), "stages": sorted(groups),
              "epochs": sorted({r["epoch"] for r in got}), "one_process_tokens_per_s": round(one_tps),
              "swarm_tokens_per_s_last": [r.get("tokens_per_s") for r in got[-3:]]}
    _emit(out, swarm_vs_one_process=result)
    if not result["every_step_once"] or len(got) < min_steps:
        raise RuntimeError(f"the log does not hold every step once: {[r['step'] for r in got]}")
    if same_dev > 1e-5:
        raise RuntimeError(f"the daemons' 2 x 2 steps differ from the same 2 x 2 in one process by {same_dev:.2e}")
    if worst is None or worst > 1e-4:
        raise RuntimeError(f"the first {min_steps} steps' losses differ from one process by {worst}")
    if not replayed["exact"] or got[-1]["epoch"] not in result["replayed_epochs"]:
        raise RuntimeError(f"the replays of the checkpoints found {replayed} (epochs {result['replayed_epochs']})")
    if not result["replicas_identical"]:
        raise RuntimeError(f"DP replicas differ: {groups}")


RUNNERS = {"pytest": check_pytest, "codecs": check_codecs, "mfu": check_mfu, "staging": check_staging,
           "precision": check_precision, "daemons": check_daemons, "compile": check_compile}


# ---------------------------------------------------------------------------------- the driver


def _read_results(path: Path) -> dict:
    merged: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                merged.update(json.loads(line))
            except ValueError:
                pass
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the checks) or cpu (a dry run of their code)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a dry run)")
    ap.add_argument("--keep-going", action="store_true", help="run every check and report every failure")
    ap.add_argument("--only", default=None, help="comma-separated checks to run (default: all, in order)")
    ap.add_argument("--total-s", type=float, default=470.0, help="bound on all checks together")
    ap.add_argument("--run-check", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.run_check:  # a child: one check
        assert args.result is not None

        def _out_of_time(signum: int, frame: object) -> None:
            raise SystemExit("out of time (SIGTERM from the driver)")
        signal.signal(signal.SIGTERM, _out_of_time)  # so that `finally` takes down what the check started
        try:
            RUNNERS[args.run_check](args.result, args.device, args.quick)
        except BaseException as e:
            traceback.print_exc()
            _emit(args.result, **{"error": f"{type(e).__name__}: {e}"[:2000]})
            return 1
        return 0

    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="dtfm-gpu-out-"))
    out.mkdir(parents=True, exist_ok=True)
    names = list(CHECKS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"unknown checks {unknown}; known: {', '.join(CHECKS)}")
    report: dict = {"device": args.device, "quick": args.quick, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "checks": {}, "failures": []}
    try:
        import torch

        report["torch"] = torch.__version__
        if torch.cuda.is_available():
            report["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    deadline = time.monotonic() + args.total_s
    scratch = Path(tempfile.mkdtemp(prefix="dtfm-gpu-res-"))
    log_path = out / "checks.log"
    for name in names:
        left = deadline - time.monotonic() - GRACE_S  # (a check that runs out of time gets GRACE_S to clean up)
        bound = min(CHECKS[name], left)
        entry: dict = {"bound_s": round(bound, 1)}
        if bound < 10:
            entry["status"] = "skipped: out of time"
            report["checks"][name] = entry
            if name not in OPTIONAL:
                report["failures"].append(f"{name}: skipped, out of time")
            continue
        res = scratch / f"{name}.jsonl"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run-check", name, "--device", args.device,
               "--result", str(res)] + (["--quick"] if args.quick else [])
        t0 = time.monotonic()
        with open(log_path, "a") as log:
            log.write(f"\n==== {name} (bound {bound:.0f} s) {time.strftime('%H:%M:%S')}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, OUT=str(out)))
            try:
                rc = proc.wait(timeout=bound)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)  # its cleanup runs (daemons taken down), then SIGKILL
                try:
                    proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = None
        entry["seconds"] = round(time.monotonic() - t0, 1)
        figures = _read_results(res)
        error = figures.pop("error", None)
        entry.update(figures)
        if rc is None:
            entry["status"] = f"timed out after {bound:.0f} s"
        elif rc != 0:
            entry["status"] = f"failed: {error or f'exit {rc}'}"
        else:
            entry["status"] = "ok"
        report["checks"][name] = entry
        print(f"[{name}] {entry['status']} in {entry['seconds']} s", file=sys.stderr, flush=True)
        if entry["status"] != "ok":
            if name in OPTIONAL:
                entry["optional"] = True
            else:
                report["failures"].append(f"{name}: {entry['status']}")
        (out / "gpu.json").write_text(json.dumps(report, indent=1))
        if report["failures"] and not args.keep_going:
            break
    report["total_s"] = round(args.total_s - (deadline - time.monotonic()), 1)
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
