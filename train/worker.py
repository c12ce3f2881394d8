"""One peer's share of a training step: its stage's pipeline pass, the DP all-reduce, global
clipping and the optimizer step.

With a `CompressionConfig` (train/compress/) activations and their gradients travel as
quantized payloads, and the DP step is exact or local: each pipeline steps on its own gradient,
and the replicas synchronise compressed pseudo-gradients every step (CocktailSGD-style) or
every H steps (DiLoCo-style; with `dp_overlap_steps` the exchange is sent after step t and
applied after step t + tau, the inner steps between computing while it travels). A per-link run's plan (`Plan.links`) says which links use the
run's pipeline codec and which DP groups its DP method; the others stay exact (an exact group
all-reduces every step, as in the warm-up, its anchor following the weights). In such a mixed
run each pipeline sums the squared gradient norm of its exact-group stages and of its other
stages apart: a stage of an exact group clips by the first sum, the same in every pipeline (its
replicas apply the same bits), the others by the whole.

Each stage runs its M micro-batches in the order of the run's `pipeline_warmups` (the
simulator's `stage_program`): that many forwards, then one forward and one backward at a time,
then the remaining backwards (1F1B with a warm-up fitted to each hop's round trip, so a link
carries activations one way while it carries gradients the other); with none set, every forward
first, then every backward (GPipe, as in the DT-FM system). Backwards run in micro-batch order
in every schedule, so the accumulated gradients are the same bits whatever the warm-ups. Each
activation is sent downstream the moment its micro-batch leaves the stage, each input
gradient upstream the moment it is computed, so transfers overlap the next micro-batch's
compute. Each micro-batch's loss is scaled by its share of the global batch, so the summed
gradients over all micro-batches and pipelines are exactly the gradient of the global batch's
mean loss, however the batch is split.

A step never waits for the acknowledgements of its own sends on its critical path (the last
gradient upstream, the loss and gradient-norm sums, the all-reduce, the tied embedding: each
about half a round trip after the step has received what it needs). With a `PendingSends`
(`run_step`'s `pending`) it leaves their handles there, and the next step waits for them just
before it changes the state, a whole step later, when they are long acknowledged: a send that
failed fails that next step, which changes nothing. The caller waits for the last step's where
the run ends and before it saves the stage (control/epoch/runner.py).

Why completing a step before one's own sends are acknowledged is safe: a step's result on this
peer is fixed by what it received (the collectives give every member the same bits), not by
whether its own tensors arrived. If one did not, the receiver fails that step (its receive
times out or its comm fails the peer) and this peer fails the next one at the latest, so the
two stand one step apart. That could happen before (a peer whose sends were all acknowledged
completes a step its neighbour then fails on another message), and the swarm handles it: a
peer keeps the stage as it was before its last completed step (the runner's one-step-back
snapshot) and the swarm resumes from the newest step every stage is held at
(control/epoch/runstate.py `resume_point`). The distance between peers does not grow: a step
needs the same messages as before, and a peer sends nothing of step k + 1 before its step k
returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from dtfm.sched import stage_program

from .codec import TORCH_DTYPES, CodecError
from .collective import all_reduce_small, ring_all_reduce
from .comm import Comm, CommError, PendingSends, SendHandle
from .compress import CompressionConfig, StageCompression, decode_activation, encode_activation
from .data import Corpus, split_batch
from .errors import PeerId
from .model import GPTStage
from .optim import AdamW, clip_coefficient
from .plan import Plan, check_compression
from .precision import autocast, ieee_fp32
from .spec import GPTSpec, TrainConfig
from .staging import HostStaging

__all__ = ["StageState", "StepResult", "check_compression", "run_step"]


class StageState:
    """A stage's weights, optimizer and compression state; `step` is the next step it will run."""

    def __init__(self, spec: GPTSpec, cfg: TrainConfig, layer_range: tuple[int, int], device: str = "cpu",
                 compression: CompressionConfig | None = None):
        first, end = layer_range
        self.spec, self.cfg, self.layer_range = spec, cfg, (first, end)
        ieee_fp32(device)  # on a GPU: fp32 is IEEE fp32, as on a CPU (train/precision.py)
        self.module = GPTStage(spec, self.layer_range, cfg.seed).to(device)
        self.params = dict(self.module.named_parameters())
        self.optim = AdamW(self.params, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.compress = StageCompression(compression or CompressionConfig(), self.params, first)
        self.staging = HostStaging(device)  # boundary tensors to and from the Comm (a no-op on a CPU)
        self.step = 0
        self.last_grad_norm = 0.0  # global gradient norm of the last step, before clipping
        # the longest wait for one message: the run's `comm_timeout_s`, which the stage's owner
        # may raise for steps that take long
        self.comm_timeout_s = cfg.comm_timeout_s

    @property
    def device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient by name, zeros for a parameter that has none yet."""
        out: dict[str, torch.Tensor] = {}
        for n, p in self.params.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out[n] = p.grad
        return out

    def counts_in_norm(self, name: str) -> bool:
        """Whether a parameter is counted in the global gradient norm (a tied copy is counted
        once, on the first stage)."""
        return not (self.module.holds_tied_copy and name == "wte.weight")


@dataclass
class StepResult:
    step: int
    loss: float | None  # global mean loss; on last stages only
    grad_norm: float  # global L2 norm before clipping
    compute_s: float = 0.0  # forward + backward compute of this stage
    pipeline_s: float = 0.0  # wall time of the forward/backward phase, waits included
    sync_s: float = 0.0  # all-reduce, norm, optimizer
    act_peak_bytes: int = 0  # peak bytes of saved activations, parameters left out (with track_memory)
    wait_s: float = 0.0  # of pipeline_s, blocked waiting for an activation or gradient to arrive
    # compute_s's CPU time (the thread's own: what the compute took with a core to itself); 0: not
    # measured (on a GPU, or with several torch threads, whose other threads' time it misses)
    compute_cpu_s: float = 0.0


class _SavedBytes:
    """Counts the bytes autograd saves for backward (the activations a GPipe stage holds), the
    stage's own parameters, which backward saves too, left out.

    `pack` keeps a detached alias of each tensor (the same storage, no autograd history), never
    the tensor it was given: an operation that saves its own output (softmax, attention, layer
    norm's statistics) would otherwise hold that output, which holds the operation back, a cycle
    kept in autograd's C++ objects that no collection can see. backward breaks it by releasing
    what it used; a forward whose backward never runs (the step failed: a neighbour died
    between them) would keep its whole graph, weights included, for the life of the daemon."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self.now = self.peak = 0
        self._seen: set[int] = {p.untyped_storage().data_ptr() for p in params}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._seen:
            self._seen.add(ptr)
            self.now += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.now)
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _expect(t: torch.Tensor, shape: tuple, peer: PeerId, tag: str) -> torch.Tensor:
    if tuple(t.shape) != shape or not t.is_floating_point():
        raise CommError(f"peer {peer!r} sent {t.dtype} {tuple(t.shape)} under {tag!r}, expected float {shape}")
    return t


@dataclass
class _Ctx:
    """What one step of one peer needs to know about its place in the plan."""

    state: StageState
    comm: Comm
    corpus: Corpus
    step: int
    key: str  # "<epoch>.<step>": prefix of every tag of this step
    prev: PeerId | None  # upstream peer, or None on the first stage
    nxt: PeerId | None  # downstream peer, or None on the last stage
    up_coded: bool  # the link from the upstream stage uses the run's pipeline codec
    down_coded: bool  # the link to the downstream stage does
    micro: list[range]  # this pipeline's sample indices per micro-batch
    saved: _SavedBytes | None
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0  # compute_s's CPU time of this thread
    wait_s: float = 0.0


def run_step(state: StageState, plan: Plan, me: PeerId, comm: Comm, corpus: Corpus, track_memory: bool = False,
             pending: PendingSends | None = None, before_update: Callable[[], None] | None = None) -> StepResult:
    """Run step `state.step` for peer `me` under `plan`, then advance `state.step`. A step that
    raises has changed nothing.

    `before_update` is called once every message of the step has arrived, just before the
    state changes (the weights, the optimizer, a compressed synchronisation's buffers): the
    last moment the stage is as it was before the step (a caller copies it there, see
    control/epoch/runner.py). Only a compressed synchronisation (or the landing of an overlapped
    one) that fails after it restores the weights, the moments and the compression buffers and
    raises.

    Without `pending` the step waits for the acknowledgement of every tensor it sends before it
    changes the state. With `pending` (the same one for every step of a run on one comm) it
    waits for the handles the previous step left there instead, and leaves its own there: wait
    for them (`pending.wait`) before saving or handing over the stage and where the run ends;
    drop them when a step failed (see the module docstring)."""
    cfg, step = state.cfg, state.step
    d, s = plan.position(me)
    if plan.layer_ranges[s] != state.layer_range:
        raise ValueError(f"peer {me!r} holds layers {state.layer_range}, the plan gives it {plan.layer_ranges[s]}")
    check_compression(state.spec, plan, state.compress.config)
    pipe = plan.pipeline(d)
    key = f"{plan.epoch}.{step}"
    ctx = _Ctx(state, comm, corpus, step, key, pipe[s - 1] if s > 0 else None,
               pipe[s + 1] if s + 1 < plan.stages else None,
               s > 0 and plan.link_compressed(s - 1, d), s + 1 < plan.stages and plan.link_compressed(s, d),
               split_batch(cfg.global_batch_seqs, plan.dp, cfg.micro_batches)[d],
               _SavedBytes(state.params.values()) if track_memory else None)
    if pending is None:  # this step's sends, waited for before the update
        sends = due = PendingSends()
    else:  # this step's sends stay in `pending`; the previous step's are waited for before the update
        sends, due = pending, pending.take()
    for p in state.params.values():
        p.grad = None
    t_start = time.perf_counter()
    losses, handles = _pipeline(ctx, stage_program(s, len(ctx.micro), _warmup(cfg, plan.stages, s, len(ctx.micro))))
    for h in handles:
        sends.add(h)
    t_pipe = time.perf_counter()
    loss = None
    if state.module.is_last:
        local = torch.stack(losses).sum().to("cpu", torch.float64).reshape(1)
        loss = float(all_reduce_small(comm, plan.dp_group(s), local, f"{key}/loss", state.comm_timeout_s, sends)[0])
    local_seqs = sum(len(r) for r in ctx.micro)
    # every message received and `due` acknowledged before the update: a failed step leaves the state as it was
    _sync_and_update(state, plan, me, comm, d, s, key, local_seqs, sends, due, deferred=pending is not None,
                     before_update=before_update)
    t_end = time.perf_counter()
    state.step += 1
    cpu_s = ctx.compute_cpu_s if state.device.type == "cpu" and torch.get_num_threads() == 1 else 0.0
    return StepResult(step, loss, state.last_grad_norm, ctx.compute_s, t_pipe - t_start, t_end - t_pipe,
                      ctx.saved.peak if ctx.saved else 0, ctx.wait_s, cpu_s)


def _send_boundary(ctx: _Ctx, peer: PeerId, tag: str, t: torch.Tensor, coded: bool) -> SendHandle:
    """isend an activation or its gradient: in the wire dtype, or as the run's compressed payload
    (`coded`: the link uses the run's pipeline codec), each made where `t` is (on a GPU: cast or
    encoded there, then staged through pinned host memory)."""
    comp, staging = ctx.state.compress.config, ctx.state.staging
    if comp.pp_method == "exact" or not coded:
        return staging.send(ctx.comm, peer, tag, t.to(TORCH_DTYPES[ctx.state.cfg.wire_dtype]))
    return staging.send(ctx.comm, peer, tag, encode_activation(t, comp))


def _recv_boundary(ctx: _Ctx, peer: PeerId, tag: str, shape: tuple, coded: bool) -> torch.Tensor:
    """The float32 activation (or gradient) of `shape` that `peer` sent under `tag`."""
    comp, staging = ctx.state.compress.config, ctx.state.staging
    t0 = time.perf_counter()
    got = ctx.comm.recv(peer, tag, ctx.state.comm_timeout_s)
    ctx.wait_s += time.perf_counter() - t0
    if comp.pp_method == "exact" or not coded:
        return staging.to_device(_expect(got, shape, peer, tag), torch.float32)
    try:  # decoded on the stage's device
        return decode_activation(staging.to_device(got, torch.uint8), shape, comp)
    except CodecError as e:
        raise CommError(f"peer {peer!r} sent a bad compressed payload under {tag!r}: {e}") from None


def _warmup(cfg: TrainConfig, stages: int, s: int, micro: int) -> int:
    """Stage s's forwards before its first backward (`TrainConfig.pipeline_warmups`; all of its
    `micro` micro-batches where none is set: GPipe; `stage_program` holds a count to them)."""
    counts = cfg.warmups(stages)
    return micro if counts is None else counts[s]


def _pipeline(ctx: _Ctx, program: list[tuple[bool, int]]) -> tuple[list[torch.Tensor], list[SendHandle]]:
    """The micro-batches forward and backward in the order of `program` ((backward, m) each,
    `sched.stage_program`); each output, or input gradient, is sent on as soon as it exists.
    Backwards run in micro-batch order whatever the order, so every schedule accumulates the
    same gradients bit for bit. Returns the last stage's losses and the sends' handles."""
    outs: dict[int, torch.Tensor] = {}
    ins: dict[int, torch.Tensor] = {}
    losses: list[torch.Tensor] = []
    handles: list[SendHandle] = []
    for backward, m in program:
        if backward:
            handles += _backward_one(ctx, m, outs.pop(m), ins.pop(m))
        else:
            out, x, loss, sent = _forward_one(ctx, m)
            outs[m], ins[m] = out, x
            if loss is not None:
                losses.append(loss)
            handles += sent
    return losses, handles


def _forward_one(ctx: _Ctx, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[SendHandle]]:
    """Micro-batch m forward; its output is sent downstream at once."""
    st, cfg, spec = ctx.state, ctx.state.cfg, ctx.state.spec
    mod, dev = st.module, st.device
    idx = ctx.micro[m]
    if mod.is_first or mod.is_last:
        x_tok, y = ctx.corpus.batch(cfg.seed, ctx.step, idx, spec.seq_len)
    if mod.is_first:
        x = x_tok.to(dev)
    else:
        tag = f"{ctx.key}/act/{m}"
        x = _recv_boundary(ctx, ctx.prev, tag, (len(idx), spec.seq_len, spec.n_embd), ctx.up_coded).requires_grad_()
    t0, c0 = time.perf_counter(), time.thread_time()
    hooks = torch.autograd.graph.saved_tensors_hooks(ctx.saved.pack, ctx.saved.unpack) if ctx.saved else nullcontext()
    loss = None
    with hooks, autocast(cfg.precision, dev):
        if mod.is_last:  # scaled by its share of the global batch: the sum is the global mean
            out = mod(x, y.to(dev)) * (len(idx) / cfg.global_batch_seqs)
            loss = out.detach()
        else:
            out = mod(x)
    ctx.compute_s += time.perf_counter() - t0
    ctx.compute_cpu_s += time.thread_time() - c0
    sent = []
    if ctx.nxt is not None:
        sent.append(_send_boundary(ctx, ctx.nxt, f"{ctx.key}/act/{m}", out.detach(), ctx.down_coded))
    return out, x, loss, sent


def _backward_one(ctx: _Ctx, m: int, out: torch.Tensor, x: torch.Tensor) -> list[SendHandle]:
    """Micro-batch m backward; its input gradient is sent upstream at once, and its activations freed."""
    mod = ctx.state.module
    if mod.is_last:
        t0, c0 = time.perf_counter(), time.thread_time()
        out.backward()
    else:
        g = _recv_boundary(ctx, ctx.nxt, f"{ctx.key}/grad/{m}", tuple(out.shape), ctx.down_coded)
        t0, c0 = time.perf_counter(), time.thread_time()
        out.backward(g)
    ctx.compute_s += time.perf_counter() - t0
    ctx.compute_cpu_s += time.thread_time() - c0
    if ctx.prev is None:
        return []
    assert x.grad is not None  # (a received activation requires its gradient: `_forward_one`)
    return [_send_boundary(ctx, ctx.prev, f"{ctx.key}/grad/{m}", x.grad, ctx.up_coded)]


def _sync_and_update(state: StageState, plan: Plan, me: PeerId, comm: Comm, d: int, s: int, key: str,
                     local_seqs: int, sends: PendingSends, due: PendingSends, deferred: bool,
                     before_update: Callable[[], None] | None = None) -> None:
    """All-reduce gradients over the DP group (or, with DP compression, keep this pipeline's own),
    sync a tied embedding, clip by the norm, step; then a compressed synchronisation when one
    is due. Every message the step receives, and the acknowledgement of every send in `due`,
    precede any change of the state, but for a compressed synchronisation, which restores the
    state if it fails. The handles of this step's sends go to `sends`; with `deferred` those of
    the compressed synchronisation too, else it waits for them before it changes anything."""
    cfg, step, mod, to = state.cfg, state.step, state.module, state.comm_timeout_s
    comp, group = state.compress, plan.dp_group(s)
    coded = plan.group_compressed(s)  # else this group all-reduces exactly, as in the warm-up
    local, sync_due = coded and comp.local(step), coded and comp.sync_due(step)
    # some groups step locally, others exactly: the norm of the exact groups' stages is summed apart
    mixed = comp.config.dp_method != "exact" and plan.links is not None and not all(plan.links.dp)
    grad_of = state.grads()
    grads = list(grad_of.values())
    if local:  # this pipeline's own step, on the mean gradient over its own samples
        for g in grads:
            g.mul_(cfg.global_batch_seqs / local_seqs)
    else:
        ring_all_reduce(comm, group, grads, f"{key}/dp", to, cfg.bucket_bytes, sends)
    if state.spec.tied_head and plan.stages > 1 and (mod.is_first or mod.is_last):
        other = plan.pipeline(d)[plan.stages - 1 if mod.is_first else 0]
        g = grad_of["wte.weight"]
        sends.add(comm.isend(other, f"{key}/tied", g))  # copied: `g` may change now
        theirs = comm.recv(other, f"{key}/tied", to)
        if theirs.shape != g.shape or theirs.dtype != g.dtype:
            raise CommError(f"peer {other!r} sent a tied-embedding gradient of the wrong shape")
        g.add_(theirs.to(g.device))  # a + b == b + a: both copies get the same bits
    sq = torch.zeros((), dtype=torch.float64, device=state.device)
    for name, g in grad_of.items():
        if state.counts_in_norm(name):
            sq += g.detach().double().pow(2).sum()
    if mixed:  # [exact groups' stages, the others]: the first sum is the same in every pipeline
        parts = torch.zeros(2, dtype=torch.float64)
        parts[0 if not coded else 1] = sq.cpu()
        total = all_reduce_small(comm, plan.pipeline(d), parts, f"{key}/norm", to, sends)
        whole = float(total[0] + total[1])
        clip_sq = float(total[0]) if not coded else whole
    else:
        total = all_reduce_small(comm, plan.pipeline(d), sq.cpu().reshape(1), f"{key}/norm", to, sends)
        whole = clip_sq = float(total[0])
    due.wait(to)  # the last wait before the state changes
    if before_update is not None:
        before_update()
    state.last_grad_norm = whole ** 0.5
    coef = clip_coefficient(clip_sq, cfg.grad_clip_norm)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    # an overlapped exchange started after an earlier step lands now (`CompressionConfig.apply_due`)
    applies = comp.config.apply_due(step) if coded else None
    overlapped = sync_due and comp.config.overlap_of(step) > 0  # sent now, applied by a later step
    saved = _snapshot(state) if sync_due or applies is not None else None
    state.optim.step(cfg.lr_at(step))
    if not local:
        comp.track_anchor(list(state.params.values()))
    if saved is not None:
        params, later = list(state.params.values()), sends if deferred else None
        try:
            if applies is not None:
                comp.finish_sync(comm, group, params, applies, f"{plan.epoch}.{applies}/dpc", f"{key}/dpc", to, later)
            if overlapped:
                comp.start_sync(comm, group, params, step, f"{key}/dpc", to, later)
            elif sync_due:
                comp.sync(comm, group, params, cfg.seed, step, f"{key}/dpc", to, later)
        except BaseException:
            _restore(state, saved)
            raise


def _snapshot(state: StageState) -> dict[str, torch.Tensor]:
    """Copies of the weights, the optimizer moments and the compression buffers (what an inner
    step and a synchronisation change)."""
    out = {f"param/{n}": p.detach().clone() for n, p in state.params.items()}
    out.update({k: v.clone() for k, v in state.optim.state_tensors().items()})
    out.update({k: v.clone() for k, v in state.compress.state_tensors().items()})
    return out


@torch.no_grad()
def _restore(state: StageState, saved: dict[str, torch.Tensor]) -> None:
    for n, p in state.params.items():
        p.copy_(saved[f"param/{n}"])
    state.optim.load_state_tensors(saved, state.optim.step_count - 1)
    state.compress.load_state_tensors(saved)
