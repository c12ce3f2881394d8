"""One peer's stage of a run: its `StageState`, stepped in a worker thread until the run ends.

The trio task that calls `StageRunner.run` owns the thread (`trio.to_thread.run_sync`). The
thread runs whole steps; between steps it checks the stop step, so a stop lands on a step
boundary. A step that fails (a neighbour died, a message timed out, or this peer's own error: out of
memory, a data set that cannot feed the model) leaves the stage as it was
before that step (`run_step` applies nothing until every message of the step has arrived) and
ends the run with the reason. Checkpoints are written every `checkpoint_every` steps, and once
more where the run ends for good (its last step, or an operator's stop: `stop_at(step,
final=True)`), at that step boundary; each is written atomically (the safetensors file, then the
JSON that makes it visible, each a temporary file renamed into place), in the worker thread,
which a cancellation waits for. Each checkpoint holds this peer's latest step reports (`history`, then its own) of the steps the weights hold
(`REPORTS_NOTE`): a restarted peer sends them in its run state, so the lines of the steps a
checkpoint holds reach the log even when every peer that reported them died before the
coordinator logged them.

The runner counts the bytes its stage sends per axis (train/compress `CountingComm`: pipeline
forward, pipeline backward, data-parallel, other) and each step's report carries them; the
coordinator's step log sums them over the peers into the step's line (`bytes_sent`).

The runner keeps the stage as it was before its last completed step (parameters, optimizer
state and, in a compressed run, the compression state: error-feedback residual, DiLoCo's anchor
and outer momentum): the snapshot, so a peer that completed a step some other stage did not can
go back one step when the swarm resumes from the step before (see control/epoch/runstate.py),
even if it failed the step after. With exact data parallelism the copy is made inside the step,
once every message of it has arrived and just before the update (`run_step`'s
`before_update`): from there the step cannot fail, so the copy is the snapshot at once, and one
copy of the stage is all it costs (and one memory copy per step). A compressed synchronisation
can still fail after its update, so a compressed run copies the stage before each step into a
second buffer that becomes the snapshot once the step completed: two copies.

The daemon has glibc map every block of 1 MiB or more on its own from its start
(`limit_heap_caching` in peer/runner.py), so a freed large tensor's memory goes back to the
system at once; the smaller ones stay in the C heap from one step to the next, where the next
step reuses them, and the runner gives the heap's free pages back (train/memory.py
`release_heap`) every `HEAP_RELEASE_STEPS` steps, after each checkpoint and where the run ends.
It keeps the stage's `StageMemory` (weights, gradients, optimizer,
snapshot, the step's activations) for the daemon's status.

The longest wait for one message (`StageState.comm_timeout_s`) is the run's `comm_timeout_s`
(60 s by default) or `COMM_TIMEOUT_STEPS` steps, whichever is longer (`comm_timeout_for`): the
steps as the allocation predicted them, and once the stage has stepped, as it measured them
(the median of its last `COMM_TIMEOUT_WINDOW` steps). A run whose steps take minutes (a large
model over slow links, a DiLoCo synchronisation of a whole stage) then does not fail every step
on a flat timeout, while a fast run still fails a frozen neighbour's step within the floor.

A step does not wait for the acknowledgements of its own sends (train/worker.py): the next step
waits for them before it changes the stage, and the runner waits for the last step's before a
checkpoint and where the run ends, before it reports the end. A send that failed then ends the
run as a failed step does, with the step it belonged to completed here (its receiver failed
it): the snapshot is what lets the swarm go back to where that receiver stands.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import trio

from dtfm.train import (
    ByteCounter,
    Comm,
    CommError,
    Corpus,
    CountingComm,
    PendingSends,
    Plan,
    StageMemory,
    StageState,
    StepResult,
    release_heap,
    run_step,
    save_checkpoint,
    stage_from_tensors,
    stage_memory,
    stage_tensors,
)

from .report import BYTE_AXES, MAX_STEP_BYTES, REPORTS_NOTE, RunEnd, StepReport

__all__ = ["COMM_TIMEOUT_STEPS", "REPORTS_NOTE", "RunEnd", "StageRunner", "StepReport", "comm_timeout_for",
           "end_checkpoint_due", "params_sha256"]

logger = logging.getLogger(__name__)

# Steps between two returns of the C heap's free pages while a run trains: a return after every
# step made the next step fault every page of its small tensors in again (a 1 x 1 `tiny` step
# 20-30 % slower than in one process, most of it in the kernel).
HEAP_RELEASE_STEPS = 64

# A message may take this many steps before its wait fails (`comm_timeout_for`), over the
# median step of the last COMM_TIMEOUT_WINDOW.
COMM_TIMEOUT_STEPS = 10
COMM_TIMEOUT_WINDOW = 8
COMM_TIMEOUT_MAX_S = 3600.0  # the most the steps raise it to (an allocation may predict any step up to 1e9 s)


def comm_timeout_for(floor_s: float, predicted_s: float | None, measured_s: Sequence[float] = ()) -> float:
    """The longest wait for one message: `floor_s` (the run's `comm_timeout_s`), or
    COMM_TIMEOUT_STEPS steps of the predicted step or of the median measured one, whichever is
    longest, the steps' figure held to COMM_TIMEOUT_MAX_S (figures that are not finite and
    positive are left out)."""
    steps = [v for v in (predicted_s,) if v is not None and math.isfinite(v) and v > 0]
    measured = [v for v in measured_s if math.isfinite(v) and v > 0]
    if measured:
        steps.append(statistics.median(measured))
    return max([floor_s] + [min(COMM_TIMEOUT_STEPS * v, COMM_TIMEOUT_MAX_S) for v in steps])


class StageRunner:
    def __init__(self, state: StageState, plan: Plan, me: bytes, comm: Comm, corpus: Corpus, *,
                 end_step: int, checkpoint_every: int = 0, checkpoint_dir: Path | None = None,
                 save: Callable[[StageState, dict], Path | None] | None = None,
                 torch_threads: int = 1, on_step: Callable[[StepReport], None] | None = None,
                 history: Sequence[StepReport] = (), keep_reports: int = 256,
                 predicted_step_s: float | None = None):
        self.state, self.plan, self.me, self.corpus = state, plan, me, corpus
        # the longest wait for one message, raised for long steps (see the module docstring)
        self._floor_s, self._predicted_s = state.cfg.comm_timeout_s, predicted_step_s
        self._step_s: collections.deque[float] = collections.deque(maxlen=COMM_TIMEOUT_WINDOW)
        state.comm_timeout_s = comm_timeout_for(self._floor_s, predicted_step_s)
        self.counter = ByteCounter()  # payload bytes this stage sent, per axis
        self.comm: Comm = CountingComm(comm, self.counter)
        self.checkpoint_every, self.checkpoint_dir = checkpoint_every, checkpoint_dir
        # writes a checkpoint (the daemon's CheckpointDisk: pruned, a refused write logged and
        # shown); None: into checkpoint_dir
        self._save = save
        # this peer's reports of the run before this runner's, then its own: saved with a checkpoint
        self._reports: collections.deque[StepReport] = collections.deque(history, maxlen=keep_reports)
        self.torch_threads = torch_threads
        self._since_release = 0  # steps since the C heap's free pages were last given back
        self._released_once = False
        self.on_step = on_step
        self._end_step = end_step
        self._stopped = False
        self._final = False  # an operator's stop: the end is checkpointed
        self._saved_step: int | None = None  # the step of the last checkpoint written
        self._lock = threading.Lock()
        self.last: StepReport | None = None
        self.running = False
        self._snapshot: dict[str, torch.Tensor] | None = None  # the stage before the last completed step
        self._snapshot_at: tuple[int, int] | None = None  # (step, optimizer step) of the snapshot
        # a compressed run's copy of the stage before the step running now (see the module docstring)
        self._pending: dict[str, torch.Tensor] | None = None
        self._pending_at: tuple[int, int] | None = None
        self._sends = PendingSends()  # the last step's sends, not yet acknowledged (worker thread)
        self.memory: StageMemory = stage_memory(state, 0, 0)  # as of the last step (written by the worker)

    @property
    def end_step(self) -> int:
        with self._lock:
            return self._end_step

    def stop_at(self, step: int, *, final: bool = False) -> None:
        """End the run before step `step` (never later than already planned); `final`: an
        operator's stop, after which the stage is checkpointed at the step where it ends."""
        with self._lock:
            if final:
                self._final = True
            if step < self._end_step:
                self._end_step = max(step, self.state.step)
                self._stopped = True

    async def run(self) -> RunEnd:
        """Run steps until the end step or a failure; the thread stays owned by this task. The
        stage's gradients go once the run ended (each step makes its own)."""
        self.running = True
        try:
            return await trio.to_thread.run_sync(self._loop, abandon_on_cancel=False)
        finally:
            self.running = False
            for p in self.state.params.values():
                p.grad = None

    def drop_snapshot(self) -> None:
        """Let go of the snapshot (once the run ended): the stage before its last step is then
        no longer held here, in memory."""
        with self._lock:
            self._snapshot = self._pending = None
            self._snapshot_at = self._pending_at = None

    def _loop(self) -> RunEnd:
        torch.set_num_threads(self.torch_threads)
        try:
            return self._steps()
        finally:
            self._release_heap()  # (the run's freed activations, buckets and received tensors)

    def _steps(self) -> RunEnd:
        in_step = self.state.compress.config.dp_method == "exact"  # the snapshot is copied inside the step
        while self.state.step < self.end_step:
            step = self.state.step
            if not in_step:
                self._take_snapshot()
            before = self.counter.snapshot()
            t0 = time.perf_counter()
            try:
                result: StepResult = run_step(self.state, self.plan, self.me, self.comm, self.corpus,
                                              track_memory=True, pending=self._sends,
                                              before_update=self._snapshot_now if in_step else None)
            except CommError as e:
                self._sends.drop()
                logger.warning("step %d failed: %s; last completed step %d", step, e, step - 1)
                return RunEnd(step - 1, str(e), True, params_sha256(self.state))
            except Exception as e:  # out of memory, a data set that cannot feed the model, a bug
                self._sends.drop()
                logger.exception("step %d failed on this peer; last completed step %d", step, step - 1)
                return RunEnd(step - 1, f"step {step} failed on this peer: {type(e).__name__}: {e}"[:500], True,
                              params_sha256(self.state), on_this_peer=True)
            if not in_step:
                self._commit_snapshot()
            self.memory = stage_memory(self.state, self._snapshot_bytes(), result.act_peak_bytes)
            self._since_release += 1
            if self._since_release >= HEAP_RELEASE_STEPS:
                self._release_heap()
            after = self.counter.snapshot()
            sent = tuple(min(after[k] - before[k], MAX_STEP_BYTES) for k in BYTE_AXES)
            report = StepReport(self.plan.epoch, result.step, result.loss, time.perf_counter() - t0,
                                result.compute_s, result.pipeline_s, result.sync_s,
                                sent, result.compute_cpu_s)  # type: ignore[arg-type]
            self.last = report
            self._reports.append(report)
            self._step_s.append(report.iteration_s)
            self.state.comm_timeout_s = comm_timeout_for(self._floor_s, self._predicted_s, self._step_s)
            if self.on_step is not None:
                self.on_step(report)
            if self.checkpoint_every and self._saves and self.state.step % self.checkpoint_every == 0:
                if (failed := self._settle()) is not None:
                    return failed
                self._checkpoint("")
        if (failed := self._settle()) is not None:
            return failed
        with self._lock:
            reason = "stopped" if self._stopped else "finished"
            final = self._final
        if end_checkpoint_due(reason, final_stop=final, step=self.state.step, saved_step=self._saved_step):
            self._checkpoint(f" (the run {reason})")
        return RunEnd(self.state.step - 1, reason, False, params_sha256(self.state))

    def _settle(self) -> RunEnd | None:
        """Wait for the acknowledgements of the last step's sends; how the run ends if one failed
        (the last step stays completed here, with its snapshot), else None."""
        try:
            self._sends.wait(self.state.comm_timeout_s)
        except CommError as e:
            last = self.state.step - 1
            logger.warning("a tensor of step %d was not acknowledged: %s", last, e)
            return RunEnd(last, f"a tensor of step {last} was not acknowledged: {e}"[:500], True,
                          params_sha256(self.state))
        return None

    def _release_heap(self) -> None:
        """Give the C heap's free pages back, once per step at most (a checkpoint where the run
        ends, or on the 64th step, is followed by the run's end or the periodic release)."""
        if self._since_release == 0 and self._released_once:
            return
        release_heap()
        self._since_release, self._released_once = 0, True

    @property
    def _saves(self) -> bool:
        return self._save is not None or self.checkpoint_dir is not None

    def _checkpoint(self, why: str) -> None:
        if not self._saves:
            return
        held = [r.to_wire() for r in self._reports if r.step < self.state.step]
        if self._save is not None:
            path = self._save(self.state, {REPORTS_NOTE: held})
            if path is None:  # (refused and logged: training goes on, the stage stays in memory)
                return
        else:
            assert self.checkpoint_dir is not None
            try:
                path = save_checkpoint(self.checkpoint_dir, self.state, notes={REPORTS_NOTE: held})
            except OSError as e:  # (a full disk: training goes on, the stage stays in memory)
                logger.error("cannot save the checkpoint of step %d in %s: %s", self.state.step, self.checkpoint_dir, e)
                return
        self._saved_step = self.state.step
        self._release_heap()
        logger.info("saved checkpoint of step %d to %s%s", self.state.step, path, why)


    # ---- one step back ----------------------------------------------------------------------

    def _snapshot_now(self) -> None:
        """Copy the stage into the snapshot inside a step, just before its update (exact data
        parallelism: from there the step completes, so the copy is the snapshot at once)."""
        with self._lock:
            self._snapshot_at = None  # (while it is being overwritten)
        self._snapshot = self._copy_stage(self._snapshot)
        with self._lock:
            self._snapshot_at = (self.state.step, self.state.optim.step_count)

    def _take_snapshot(self) -> None:
        """Copy the stage before a step (a compressed run); it becomes the snapshot only once the
        step completed, so a failed step never overwrites the way back to the step before the
        last completed one."""
        self._pending = self._copy_stage(self._pending)
        self._pending_at = (self.state.step, self.state.optim.step_count)

    def _copy_stage(self, into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The stage's tensors copied into `into` (allocated when None or of other tensors)."""
        tensors = stage_tensors(self.state)
        if into is None or into.keys() != tensors.keys():
            pin = self.state.device.type == "cuda"  # a GPU stage copies into pinned memory, asynchronously
            into = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in tensors.items()}
        for k, v in tensors.items():
            # on a GPU queued before the update (or the step's own work), which cannot change the
            # values it reads; the step waits for its GPU work (its norm) before it returns
            into[k].copy_(v, non_blocking=True)
        return into

    def _snapshot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for copy in (self._snapshot, self._pending) if copy is not None
                   for t in copy.values())

    def _commit_snapshot(self) -> None:
        with self._lock:
            self._snapshot, self._pending = self._pending, self._snapshot
            self._snapshot_at = self._pending_at

    @property
    def snapshot_step(self) -> int | None:
        """The step of the snapshot taken before the last step this runner ran (None: none)."""
        with self._lock:
            return None if self._snapshot_at is None else self._snapshot_at[0]

    def snapshot_state(self) -> StageState | None:
        """A new StageState equal to the stage before its last step; call only once the run ended."""
        with self._lock:
            if self._snapshot is None or self._snapshot_at is None:
                return None
            step, ostep = self._snapshot_at
            s = self.state
            if s.device.type == "cuda":
                torch.cuda.synchronize(s.device)
            return stage_from_tensors(s.spec, s.cfg, s.layer_range, self._snapshot, step, ostep, str(s.device),
                                      s.compress.config)


def end_checkpoint_due(reason: str, *, final_stop: bool, step: int, saved_step: int | None) -> bool:
    """Whether a runner that ended cleanly (`reason` "finished" or "stopped", at step boundary
    `step`) saves its stage there: when the run is over for good (its last step, or an
    operator's stop) and that step is not saved already. A reconfiguration's stop is not: the
    stage stays in memory for the next epoch, and a checkpoint of a large stage costs seconds."""
    over = reason == "finished" or (reason == "stopped" and final_stop)
    return over and step > 0 and saved_step != step


def params_sha256(state: StageState) -> str:
    """sha256 over the stage's parameters, by name: equal on replicas that hold equal weights."""
    h = hashlib.sha256()
    for name in sorted(state.params):
        h.update(name.encode())
        h.update(state.params[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
