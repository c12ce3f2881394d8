"""Training on a scripted swarm: start a run on one peer, follow it, keep its log in the run dir.

The issuer daemon writes `train.jsonl` (one line per step every peer completed) in its data
dir; `sync_log` copies it into the run dir (atomically), so `RUN_DIR/train.jsonl` is the run's
log whichever peer issued it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .proc import peer_request, peer_status
from .state import PeerEntry, SwarmError, SwarmState

__all__ = ["issuer_of", "plot_loss", "read_log", "start_training", "sync_log", "wait_step"]

LOG_NAME = "train.jsonl"


def start_training(state: SwarmState, peer: PeerEntry, args: dict, timeout_s: float = 180.0) -> dict:
    """`train_start` on `peer`: it schedules on its view, hands the allocation out and starts."""
    return peer_request(peer, "train_start", args, timeout_s=timeout_s)


def issuer_of(state: SwarmState) -> tuple[PeerEntry, dict] | None:
    """The peer whose status shows the latest issued run, with that status's training part."""
    best = None
    for peer in state.peers:
        st = peer_status(peer)
        issued = ((st or {}).get("training") or {}).get("issued")
        if issued is not None and (best is None or issued.get("started_at", 0) >= best[1].get("started_at", 0)):
            best = (peer, issued)
    return best


def sync_log(run_dir: Path, issuer: PeerEntry) -> Path | None:
    """Copy the issuer's training log into the run dir; the path, or None when there is none."""
    src = Path(issuer.data_dir) / LOG_NAME
    if not src.exists():
        return None
    dst = run_dir / LOG_NAME
    tmp = dst.with_name(f".{LOG_NAME}.{os.getpid()}.tmp")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)
    return dst


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_step(state: SwarmState, run_dir: Path, step: int, timeout_s: float, poll_s: float = 0.5) -> dict:
    """Block until the swarm completed step `step`; SwarmError with the reason if training
    stopped first or the time ran out. Returns the issuer's run status."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while True:
        found = issuer_of(state)
        if found is not None:
            peer, issued = found
            last = issued
            sync_log(run_dir, peer)
            if issued.get("completed", -1) >= step:
                return issued
            if issued.get("state") in ("stopped", "refused"):
                raise SwarmError(f"training {issued['state']} after step {issued.get('completed')}: "
                                 f"{issued.get('reason') or 'no reason given'}")
            if issued.get("state") == "finished":
                raise SwarmError(f"training finished at step {issued.get('completed')}, before step {step}")
        if time.monotonic() > deadline:
            where = f"last completed step {last.get('completed')}" if last else "no run found"
            raise SwarmError(f"step {step} not reached within {timeout_s:g} s ({where})")
        time.sleep(poll_s)


def plot_loss(run_dir: Path) -> Path | None:
    """`loss.png` from the run dir's train.jsonl; None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_log(run_dir / LOG_NAME) if r.get("loss") is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("tiny GPT on the swarm")
    fig.tight_layout()
    out = run_dir / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
