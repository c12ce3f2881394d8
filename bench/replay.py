"""Each checkpointed step of a swarm's run replayed in one process: the local oracle of exactness.

A long run whose shape changes (a new DP degree, another micro-batch count) adds its float32
gradients in another order than one process does, and two trainings that differ in their last
bits drift apart over hundreds of steps. A comparison with one process over the whole run then
measures that drift, not whether each step was computed right. This replay measures the latter:
for every step S at which the swarm's peers checkpointed every stage (their data dirs'
`checkpoints/RUN/stage-A-B/step-S.json`, hash-checked), the stages are joined into the whole
model with its optimizer state, trained from S in one process for the steps up to the next
checkpoint, and each loss compared with the one the swarm logged (the merged train.jsonl):
a step run from wrong weights, wrong data or a wrong optimizer state differs by far more than
1e-5, float order over a few steps by about 1e-7.

Where a stage has several checkpoints of one step (its DP replicas, or a branch a rollback
undid, whose dead holder kept it), the newest file is taken: a re-run step overwrites the
undone branch's checkpoint on the peers that ran it. A checkpoint is replayed once, against the
losses logged when it is; a step counts as covered when the loss the final log holds for it is
the one a replay compared (`coverage`: the covered share of the log's steps; a step a rollback
ran again after its replay is not covered, unless a later checkpoint's replay compared it).

    .venv/bin/python bench/replay.py RUN_DIR [--steps N]

Prints one line per replayed checkpoint and, last, one JSON object (`replayed_steps`,
`checkpoints`, `worst_relative`, `exact`, `coverage`). bench/soak.py runs it while it soaks,
every few seconds for every checkpoint whose next steps are logged (checkpoints are pruned: the
newest few per stage stay), and all it finds at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import read_rows

from dtfm.train import load_checkpoint, load_corpus, reference_step, stage_from_tensors, stage_tensors
from dtfm.train.checkpoint import CheckpointError, checkpoint_at, saved_checkpoints

REL = 1e-5


@dataclass
class Replay:
    """What the replays found so far."""

    replayed: set[int] = field(default_factory=set)  # checkpoint steps replayed (or unreadable)
    compared: dict[int, float] = field(default_factory=dict)  # step -> the logged loss a replay compared
    steps: int = 0  # logged steps compared
    worst_relative: float = 0.0
    failures: list[str] = field(default_factory=list)  # checkpoints that could not be joined or read
    per_checkpoint: dict[int, float] = field(default_factory=dict)  # checkpoint step -> worst relative deviation
    # the bound of `exact`: float order over a few steps on a CPU is about 1e-7; on a GPU, where a
    # batch's shape picks the kernels and Adam turns a near-zero gradient's last bits into whole
    # updates, 1e-5 within a few steps is seen in one process too (bench/gpu.py bounds it by 1e-4)
    rel: float = REL

    def coverage(self, rows: list[dict]) -> float:
        """The share of `rows` (the final log) whose loss is the one a replay compared."""
        hit = sum(1 for r in rows if r.get("loss") is not None and self.compared.get(r["step"]) == r["loss"])
        return hit / len(rows) if rows else 0.0

    def to_dict(self, rows: list[dict] | None = None) -> dict:
        out = {"checkpoints": len(self.replayed), "replayed_steps": self.steps,
               "worst_relative": self.worst_relative, "exact": self.steps > 0 and self.worst_relative <= self.rel,
               "bound": self.rel,
               "per_checkpoint": {str(k): float(f"{v:.2e}") for k, v in sorted(self.per_checkpoint.items())},
               "failures": self.failures[-5:]}
        if rows is not None:
            out["coverage"] = round(self.coverage(rows), 4)
        return out


def checkpoint_sets(run_dir: Path) -> dict[int, dict[tuple[int, int], Path]]:
    """Per step, the newest checkpoint of each layer range found in the run dir's peers."""
    found: dict[int, dict[tuple[int, int], tuple[float, Path]]] = {}
    for root in run_dir.glob("p*/checkpoints/*"):
        for a, b, step in saved_checkpoints(root):
            path = checkpoint_at(root, (a, b), step)
            try:
                mtime = path.stat().st_mtime if path is not None else None
            except OSError:  # (pruned meanwhile)
                continue
            if path is None or mtime is None:
                continue
            have = found.setdefault(step, {})
            if (a, b) not in have or have[(a, b)][0] < mtime:
                have[(a, b)] = (mtime, path)
    return {s: {r: p for r, (_, p) in ranges.items()} for s, ranges in found.items()}


def _cover(ranges: dict[tuple[int, int], Path]) -> list[Path] | None:
    """Checkpoints whose layer ranges tile the model from layer 0 to its last (None: a gap)."""
    n_layer = int(json.loads(next(iter(ranges.values())).read_text())["spec"]["n_layer"])
    by_start = {a: (b, p) for (a, b), p in ranges.items()}
    out, at = [], 0
    while at < n_layer and at in by_start:
        at, p = by_start[at]
        out.append(p)
    return out if at == n_layer else None


def replay(run_dir: Path, result: Replay, *, max_steps: int = 10, say=print, device: str = "cpu") -> Replay:
    """Replay the checkpoint sets of `run_dir` not replayed yet whose logged steps are there,
    newest first, each for the steps up to the next checkpoint, at most `max_steps`, in one
    process on `device` (a GPU swarm's steps are replayed on its GPU)."""
    rows = {r["step"]: r for r in read_rows(run_dir)} if (run_dir / "train.jsonl").exists() else {}
    sets = checkpoint_sets(run_dir)
    steps = sorted(sets)
    corpus = None
    for k, s in reversed(list(enumerate(steps))):
        if s in result.replayed:
            continue
        nxt = steps[k + 1] if k + 1 < len(steps) else s + max_steps
        todo = list(range(s, min(nxt, s + max_steps)))
        if not todo or any(t not in rows or rows[t].get("loss") is None for t in todo):
            continue  # (not logged yet: a later call replays it)
        try:
            cover = _cover(sets[s])
            if cover is None:
                continue  # (not every stage checkpointed this step where the run dir holds it)
            parts = [load_checkpoint(p) for p in cover]
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            if not all(p.exists() and p.with_suffix(".safetensors").exists() for p in sets[s].values()):
                continue  # (pruned by its peer meanwhile: a live swarm keeps the newest few)
            result.failures.append(f"step {s}: {e}")
            result.replayed.add(s)
            continue
        tensors = {}
        for part in parts:
            tensors.update(stage_tensors(part))
        first = parts[0]
        whole = stage_from_tensors(first.spec, first.cfg, (0, first.spec.n_layer), tensors, s,
                                   first.optim.step_count, device=device)
        corpus = corpus or load_corpus()
        worst = 0.0
        for t in todo:
            ref = reference_step(whole, corpus)
            worst = max(worst, abs(rows[t]["loss"] - ref) / max(abs(ref), 1e-12))
            result.compared[t] = rows[t]["loss"]
        result.replayed.add(s)
        result.steps += len(todo)
        result.worst_relative = max(result.worst_relative, worst)
        result.per_checkpoint[s] = worst
        say(f"checkpoint of step {s} ({len(cover)} stages): steps {todo[0]}-{todo[-1]} replayed, "
            f"worst relative deviation {worst:.1e}")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a dtfm-swarm run dir (its peers' data dirs and train.jsonl)")
    ap.add_argument("--steps", type=int, default=10, help="most steps replayed from one checkpoint (default: %(default)s)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads of the replay (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="where the replay trains: cpu or cuda (default: %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    result = replay(args.run_dir, Replay(), max_steps=args.steps, say=lambda m: print(m, file=sys.stderr),
                    device=args.device)
    rows = read_rows(args.run_dir) if (args.run_dir / "train.jsonl").exists() else []
    found = result.to_dict(rows)
    print(json.dumps(found))
    return 0 if found["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
