"""Run S x D training in one process: one thread per stage replica, on the in-memory Comm.

`LocalCluster` keeps each peer's StageState across steps. `reconfigure(plan)` switches to a
new plan at a step boundary (a different D, or different layer ranges): a peer whose stage
changes assembles its new stage from the holders of the old ones through the transfer
encoding (chunked, hash-verified), exactly what peers of a swarm exchange.

`compression` (a `CompressionConfig`, exact by default) is every stage's compression; each
peer's Comm counts the bytes it sends per axis (`bytes_sent`, `last_step_bytes`: payload
lengths as produced, summed over all peers).

Each peer's step leaves the handles of its sends for its next step to wait for, as in the
swarm (train/worker.py); `reconfigure` waits for the last step's first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .comm import CommClosed, InMemoryHub, Link, PendingSends
from .compress import AXES, ByteCounter, CompressionConfig, CountingComm
from .data import Corpus, split_batch
from .errors import PeerId
from .plan import Plan
from .spec import GPTSpec, TrainConfig
from .transfer import TransferError, TransferReceiver, encode_transfer
from .checkpoint import stage_from_tensors
from .worker import StageState, StepResult, check_compression, run_step

__all__ = ["LocalCluster"]

logger = logging.getLogger(__name__)


def _one_thread() -> None:
    torch.set_num_threads(1)


class LocalCluster:
    def __init__(self, spec: GPTSpec, cfg: TrainConfig, plan: Plan, corpus: Corpus,
                 states: dict | None = None, track_memory: bool = False, device: str = "cpu",
                 link: Callable[[PeerId, PeerId], Link] | None = None,
                 compression: CompressionConfig | None = None) -> None:
        if plan.n_layer != spec.n_layer:
            raise ValueError(f"plan covers {plan.n_layer} layers, the model has {spec.n_layer}")
        self.spec, self.cfg, self.corpus, self.track_memory = spec, cfg, corpus, track_memory
        self.device, self.link = device, link  # link(src, dst) -> comm.Link: emulated network, or None
        self.compression = compression or CompressionConfig()
        split_batch(cfg.global_batch_seqs, plan.dp, cfg.micro_batches)  # fail now, not inside a worker
        corpus.check_vocab(spec.vocab)
        check_compression(spec, plan, self.compression)
        self.hub = InMemoryHub(link=self.link)
        self.counter = ByteCounter()
        self.last_step_bytes: dict[str, int] = dict.fromkeys(AXES, 0)
        self.plan = plan
        self.states: dict = {}
        if states is None:
            for p in plan.peers:
                self.states[p] = StageState(spec, cfg, plan.layer_ranges[plan.position(p)[1]], device,
                                            self.compression)
        else:
            self.states = dict(states)
            self._check_states()
        self._pool = ThreadPoolExecutor(max_workers=len(plan.peers), initializer=_one_thread)
        self._pending = {p: PendingSends() for p in plan.peers}  # each peer's sends not yet waited for
        self.last_results: dict = {}

    def _check_states(self) -> None:
        steps = {st.step for st in self.states.values()}
        if len(steps) != 1:
            raise ValueError(f"stages disagree on the step: {sorted(steps)}")
        for p in self.plan.peers:
            if p not in self.states or self.states[p].layer_range != self.plan.layer_ranges[self.plan.position(p)[1]]:
                raise ValueError(f"peer {p!r} has no state for its stage")
            if self.states[p].compress.config != self.compression:
                raise ValueError(f"peer {p!r} holds a stage compressed with {self.states[p].compress.config.describe()!r}, "
                                 f"the cluster runs {self.compression.describe()!r}")

    @property
    def step_index(self) -> int:
        return next(iter(self.states.values())).step

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Payload bytes sent so far by all peers, per axis (pp_fwd, pp_bwd, dp, other)."""
        return self.counter.snapshot()

    def step(self) -> float:
        """Run one step on every peer; the global loss of that step."""
        before = self.counter.snapshot()
        futs = {p: self._pool.submit(self._run, p) for p in self.plan.peers}
        results, errors = {}, []
        for p, f in futs.items():
            try:
                results[p] = f.result()
            except BaseException as e:  # keep the first real failure, not the aborts it caused
                errors.append(e)
        if errors:
            for pending in self._pending.values():  # the step failed on its comm: nothing to wait for
                pending.drop()
            real = [e for e in errors if not isinstance(e, CommClosed)]
            raise (real or errors)[0]
        self.last_results = results
        after = self.counter.snapshot()
        self.last_step_bytes = {a: after[a] - before[a] for a in AXES}
        losses = {r.loss for r in results.values() if r.loss is not None}
        if len(losses) != 1:
            raise RuntimeError(f"last stages disagree on the loss: {losses}")
        return losses.pop()

    def _run(self, peer: PeerId) -> StepResult:
        try:
            return run_step(self.states[peer], self.plan, peer, CountingComm(self.hub.endpoint(peer), self.counter),
                            self.corpus, self.track_memory, self._pending[peer])
        except BaseException:
            self.hub.abort()
            raise

    def run(self, steps: int) -> list[float]:
        return [self.step() for _ in range(steps)]

    def reconfigure(self, plan: Plan, chunk_bytes: int = 1 << 16) -> None:
        """Switch to `plan` before the next step, moving stage state by the transfer encoding."""
        if plan.n_layer != self.spec.n_layer:
            raise ValueError(f"plan covers {plan.n_layer} layers, the model has {self.spec.n_layer}")
        split_batch(self.cfg.global_batch_seqs, plan.dp, self.cfg.micro_batches)
        check_compression(self.spec, plan, self.compression)
        self.settle()
        sources: dict[tuple[int, int], StageState] = {}  # one holder per distinct old layer range
        for p, st in self.states.items():
            sources.setdefault(st.layer_range, st)
        received: dict[tuple, dict] = {}
        new_states = {}
        for p in plan.peers:
            rng = plan.layer_ranges[plan.position(p)[1]]
            old = self.states.get(p)
            if old is not None and old.layer_range == rng:
                new_states[p] = old
                continue
            tensors = {}
            for src_rng, st in sources.items():
                overlaps = src_rng[0] < rng[1] and rng[0] < src_rng[1]
                if overlaps or st.module.is_first or st.module.is_last:  # ends: embeddings, head, tied copy
                    if src_rng not in received:
                        received[src_rng] = self._fetch(st, chunk_bytes)
                    tensors.update(received[src_rng])
            step, ostep = self.step_index, sources[next(iter(sources))].optim.step_count
            new_states[p] = stage_from_tensors(self.spec, self.cfg, rng, tensors, step, ostep, self.device,
                                               self.compression)
            logger.info("peer %r took over layers %s at step %d", p, rng, step)
        self.plan, self.states = plan, new_states
        self._check_states()
        for st in self.states.values():  # an overlapped exchange in flight is sent again on the new hub
            st.compress.forget_exchange()
        self.hub = InMemoryHub(link=self.link)
        self._pending = {p: PendingSends() for p in plan.peers}
        self._pool.shutdown()
        self._pool = ThreadPoolExecutor(max_workers=len(plan.peers), initializer=_one_thread)

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the sends of the last step, each within `timeout_s` (the run's
        comm_timeout_s by default); CommError if one failed."""
        for pending in self._pending.values():
            pending.wait(self.cfg.comm_timeout_s if timeout_s is None else timeout_s)

    @staticmethod
    def _fetch(st: StageState, chunk_bytes: int) -> dict:
        manifest, chunks = encode_transfer(st, chunk_bytes)
        rx = TransferReceiver(manifest)
        for i, c in enumerate(chunks):
            rx.feed(i, c)
        try:
            return rx.tensors()
        except TransferError:
            logger.warning("stage %s failed verification on transfer", st.layer_range)
            raise

    def close(self) -> None:
        self.hub.abort()
        self._pool.shutdown()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
