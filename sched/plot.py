"""Drawing an allocation (matplotlib; imported only by --plot).

Left: pipelines across regions, one row per pipeline, one column per stage, each peer coloured
by its region, spares at the right. Right: the latency matrix as a heat map with peers ordered
pipeline by pipeline (each pipeline's stages in order, spares last), so the low-latency blocks
the scheduler found for each pipeline's neighbours sit on the diagonal.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["plot_allocation"]


def plot_allocation(path: str | os.PathLike[str], delay_ms: np.ndarray, regions: list[str], X: np.ndarray,
                    spares: Sequence[int], title: str) -> None:
    S, D = X.shape
    names = list(dict.fromkeys(regions))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colour = {r: cmap(k % cmap.N) for k, r in enumerate(names)}
    fig, (ax, hm) = plt.subplots(1, 2, figsize=(14, 6))
    for p in range(D):
        ax.plot(range(S), [p] * S, color="0.8", zorder=1)
        ax.scatter(range(S), [p] * S, c=[colour[regions[i]] for i in X[:, p]], s=120, zorder=2)
    for k, z in enumerate(spares):
        ax.scatter([S + 0.5], [k], c=[colour[regions[z]]], marker="x", s=80)
    ax.set_xlabel("stage")
    ax.set_ylabel("pipeline")
    ax.set_title(title, fontsize=10)
    for r in names:
        ax.scatter([], [], c=[colour[r]], label=r)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    order = np.concatenate([X.T.ravel(), np.asarray(spares, dtype=np.int64)])
    im = hm.imshow(delay_ms[np.ix_(order, order)], cmap="viridis")
    for d in range(1, D + (1 if len(spares) else 0)):
        hm.axhline(d * S - 0.5, color="w", lw=0.5)
        hm.axvline(d * S - 0.5, color="w", lw=0.5)
    ticks = [d * S + (S - 1) / 2 for d in range(D)] + ([D * S + (len(spares) - 1) / 2] if len(spares) else [])
    labels = [f"pipeline {d}" for d in range(D)] + (["spares"] if len(spares) else [])
    step = max(1, len(ticks) // 16)  # at most ~16 labels on an axis
    hm.set_xticks(ticks[::step], labels[::step], fontsize=7, rotation=90)
    hm.set_yticks(ticks[::step], labels[::step], fontsize=7)
    hm.set_xlabel(f"to peer: pipeline by pipeline, stages 0..{S - 1} in each")
    hm.set_ylabel("from peer")
    hm.set_title("one-way latency (ms) between the allocated peers")
    fig.colorbar(im, ax=hm)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
