"""Drawing an allocation (needs matplotlib, the optional `plot` extra; imported only by --plot).

Left: pipelines across regions, one row per pipeline, one column per stage, each peer coloured
by its region, spares at the right. Right: the latency matrix as a heat map with peers ordered
stage by stage as allocated, so DP groups appear as blocks on the diagonal.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["plot_allocation"]


def plot_allocation(path, delay_ms: np.ndarray, regions: list[str], X: np.ndarray, spares, title: str) -> None:
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
    ax.set_title(title)
    for r in names:
        ax.scatter([], [], c=[colour[r]], label=r)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    order = np.concatenate([X.ravel(), np.asarray(spares, dtype=np.int64)])
    im = hm.imshow(delay_ms[np.ix_(order, order)], cmap="viridis")
    for s in range(1, S):
        hm.axhline(s * D - 0.5, color="w", lw=0.5)
        hm.axvline(s * D - 0.5, color="w", lw=0.5)
    hm.set_title("one-way latency (ms), peers in stage order")
    fig.colorbar(im, ax=hm)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
