"""The stages this peer holds, and what it tells the coordinator about them.

A peer keeps its stage after an epoch ends, the one-step-back snapshot its runner takes before
each step, and its checkpoints. RUN_STATE `query` answers with its run state (the applied
(term, epoch), its layers and step, its checkpoints, its last step reports), from which the
coordinator picks the resume point; RUN_STATE `offer` encodes the stage at the resume step for
the recovery server and answers its manifest digest. A peer whose own copy's digest is the one
the new allocation names keeps it instead of fetching.

`HolderRole` is mixed into `ControlPlane` (control/plane.py); it uses the plane's state through
`self`.
"""

from __future__ import annotations

from pathlib import Path

import trio

from dtfm.net import ProtocolError, get_bytes, get_dict, get_int, get_str
from dtfm.train import CheckpointError, StageState, checkpoint_at, load_checkpoint, saved_checkpoints

from .allocation import Allocation, Holding
from .coordinator.runstate import PeerRunState

__all__ = ["HolderRole"]


class HolderRole:
    """A peer's methods of `ControlPlane` for the stages it holds (a mixin: see the module
    docstring)."""

    async def _own_copy(self, alloc: Allocation, h: Holding) -> StageState | None:
        """This peer's copy of a holding, if its digest is the allocation's."""
        state = self._offered_state(alloc.run_id, alloc.start_step, h.layer_range, h.digest)
        if state is None:
            await self.offer(alloc.run_id, alloc.start_step, h.layer_range)
            state = self._offered_state(alloc.run_id, alloc.start_step, h.layer_range, h.digest)
        return state

    def _state_at(self, run_id: bytes, layers: tuple[int, int], step: int) -> StageState | None:
        """This peer's stage of `layers` at `step`: its stage, its one-step-back snapshot, or a
        checkpoint. Only once its worker stopped."""
        for run in (self._run, self._prev):
            if run is None or run.state is None or run.alloc.run_id != run_id or run.active:
                continue
            if tuple(run.state.layer_range) != tuple(layers):
                continue
            if run.state.step == step:
                return run.state
            if run.runner is not None and run.runner.snapshot_step == step:
                return run.runner.snapshot_state()
        path = checkpoint_at(self._checkpoint_root(run_id), layers, step)
        return load_checkpoint(path) if path is not None else None

    def _offered_state(self, run_id: bytes, step: int, layers: tuple[int, int], digest: str) -> StageState | None:
        found = self._offered.get((run_id, step, tuple(layers)))
        if found is None or found[0] != digest or found[1].step != step:  # a stage trained on since
            return None
        return found[1]

    def _checkpoint_root(self, run_id: bytes) -> Path:
        """Where this peer saves its checkpoints of run `run_id`: one folder per run, so a run
        never takes another run's checkpoint of the same layers and step for its own."""
        return self.data_dir / "checkpoints" / run_id.hex()

    def _checkpoints(self, run_id: bytes | None) -> tuple[tuple[int, int, int], ...]:
        """(first layer, end layer, step) of this peer's newest checkpoints of run `run_id`."""
        if run_id is None:
            return ()
        steps: dict[tuple[int, int], list[int]] = {}
        for a, b, step in saved_checkpoints(self._checkpoint_root(run_id)):
            steps.setdefault((a, b), []).append(step)
        out = [(a, b, step) for (a, b), saved in steps.items() for step in saved[-2:]]
        return tuple(out[-16:])

    def run_state(self) -> PeerRunState:
        run = self._run
        if run is None:
            return PeerRunState(None, *self.election.last_applied, None, None, None, False, (),
                                tuple(self._reports))
        held = run if run.state is not None else self._prev
        layers = at = prev = None
        if held is not None and held.state is not None and held.alloc.run_id == run.alloc.run_id:
            layers = tuple(held.state.layer_range) if held is run else None
            if held is run:
                at = run.state.step
                prev = run.runner.snapshot_step if run.runner is not None else None
        return PeerRunState(run.alloc.run_id, run.alloc.term, run.alloc.epoch, layers, at, prev, run.active,
                            self._checkpoints(run.alloc.run_id), tuple(self._reports))

    async def _on_run_state(self, conn, msg_type, body, payload) -> dict:
        d = get_dict(body, "RUN_STATE")
        op = get_str(d, "op", 16)
        if op == "query":
            return self.run_state().to_wire()
        if op != "offer":
            raise ProtocolError(f"RUN_STATE: unknown op {op!r}")
        run_id = get_bytes(d, "run", 16, 16)
        step = get_int(d, "step", 0, 2**63 - 1)
        layers = d.get("layers")
        if not isinstance(layers, list) or len(layers) != 2 or not all(type(x) is int for x in layers):
            raise ProtocolError("RUN_STATE: layers must be [first, end]")
        if conn.peer_id != self.election.coordinator:
            return {"error": "only the coordinator asks for offers"}
        return await self.offer(run_id, step, (layers[0], layers[1]))

    async def offer(self, run_id: bytes, step: int, layers: tuple[int, int]) -> dict:
        try:
            state = await trio.to_thread.run_sync(self._state_at, run_id, layers, step)
        except CheckpointError as e:
            return {"error": f"checkpoint unreadable: {e}"}
        if state is None:
            return {"error": f"layers {layers} at step {step} are not held here"}
        offer = await self.recovery.offer(run_id, state)
        self._offered = {k: v for k, v in self._offered.items() if k[0] == run_id and k[1] >= step - 1}
        self._offered[(run_id, step, tuple(layers))] = (offer.digest, state)
        return {"digest": offer.digest, "bytes": offer.manifest.total_bytes}
