"""Local search over allocations: swaps of two peers, or of a peer and a spare, scored incrementally.

For a chosen peer x (stage s, pipeline p) every swap partner y is scored at once with numpy:
the two changed DP groups from the groups' row sums (O(D) per candidate), the four changed
stage boundaries from each boundary's two largest hops, the rest of the objective unchanged.
Partners in the neighbouring stages (whose boundaries overlap x's) are scored from their
rebuilt boundaries, vectorised over pipelines. Within one stage, pipelines are re-paired by the exact bottleneck matchings instead.

With the paper objective the incremental score is exact. With the extensions (compute, memory,
uneven layers) it screens: the best few candidates are re-scored exactly before one is taken.
"""

from __future__ import annotations

import numpy as np

from .cost import CostModel

__all__ = ["SwapSearch"]

_EPS = 1e-12
_VERIFY = 4  # candidates re-scored exactly per peer when the extensions are on


class SwapSearch:
    def __init__(self, model: CostModel, rng: np.random.Generator, deadline) -> None:
        self.m = model
        self.rng = rng
        self.deadline = deadline  # callable -> True when time is up
        self.symmetric = bool(np.allclose(model.dp_a, model.dp_a.T) and np.allclose(model.dp_b, model.dp_b.T))
        self.moves = 0
        self.scored = 0

    # -- state ----------------------------------------------------------------------------
    def _load(self, X: np.ndarray, Z: np.ndarray) -> None:
        m = self.m
        self.X, self.Z = X, Z
        S, D = X.shape
        layers, _ = m.group_layers(X)
        self.g = np.array([m.workload.grad_gb(c) for c in layers])
        ix = (X[:, :, None], X[:, None, :])
        self.Wg = m.dp_a[ix] + self.g[:, None, None] * m.dp_b[ix]  # (S, D, D)
        self.R = self.Wg.sum(axis=2)  # (S, D)
        self.dpst = self.R.max(axis=1)
        self.Hb = m.hop[X[:-1], X[1:]]  # (S-1, D)
        self.bmax = self.Hb.max(axis=1) if S > 1 else np.zeros(0)
        self.pp = float(self.bmax.sum())
        self.net = float(self.dpst.max() + 2 * self.pp)
        self.sec = float(self.dpst.sum())
        self.exact = m.breakdown(X).total_s if m.extensions else self.net

    def _pair_w(self, rows: np.ndarray, cols: np.ndarray, g: float) -> np.ndarray:
        ix = np.ix_(rows, cols)
        return self.m.dp_a[ix] + g * self.m.dp_b[ix]

    # -- scoring --------------------------------------------------------------------------
    def _row_s_with(self, s: int, p: int, Y: np.ndarray) -> np.ndarray:
        """DP cost of group s when each y in Y replaces X[s, p]."""
        D = self.X.shape[1]
        if D == 1:
            return np.zeros(len(Y))
        others = np.delete(np.arange(D), p)
        om = self.X[s, others]
        w_oy = self._pair_w(om, Y, self.g[s])  # (D-1, |Y|)
        members = (self.R[s, others] - self.Wg[s, others, p])[:, None] + w_oy
        own = (w_oy.T if self.symmetric else self._pair_w(Y, om, self.g[s])).sum(axis=1)
        return np.maximum(members.max(axis=0), own)

    def _x_side_pp(self, s: int, p: int, Y: np.ndarray, excl: np.ndarray) -> np.ndarray:
        """Change of PPcost at boundaries s-1 and s when each y in Y replaces X[s, p]."""
        X, hop = self.X, self.m.hop
        S = X.shape[0]
        out = np.zeros(len(Y))
        if s > 0:
            out += np.maximum(excl[s - 1, p], hop[X[s - 1, p], Y]) - self.bmax[s - 1]
        if s < S - 1:
            out += np.maximum(excl[s, p], hop[Y, X[s + 1, p]]) - self.bmax[s]
        return out

    def _far_swaps(self, s: int, p: int, excl: np.ndarray):
        """Scores (net, sec) of swapping x with every active peer (its own stage excluded)."""
        X, m = self.X, self.m
        S, D = X.shape
        x = X[s, p]
        Y = X.ravel()
        new_s = self._row_s_with(s, p, Y).reshape(S, D)
        cx = m.dp_a[X, x] + self.g[:, None] * m.dp_b[X, x]  # W[X[t, m], x]
        T = (self.R + cx)[:, None, :] - self.Wg.transpose(0, 2, 1)  # [t, q, m]
        T[:, np.arange(D), np.arange(D)] = -np.inf
        rx = cx if self.symmetric else m.dp_a[x, X] + self.g[:, None] * m.dp_b[x, X]
        new_t = np.maximum(T.max(axis=2), rx.sum(axis=1)[:, None] - rx)
        dpx = self.dpst.copy()
        dpx[s] = -np.inf
        i1 = int(np.argmax(dpx))
        v1 = dpx[i1]
        dpx[i1] = -np.inf
        v2 = dpx.max() if S > 2 else -np.inf
        other = np.where(np.arange(S) == i1, v2, v1)[:, None]
        new_dp = np.maximum(np.maximum(new_s, new_t), other)
        sec = self.sec - self.dpst[s] - self.dpst[:, None] + new_s + new_t
        dpp = self._x_side_pp(s, p, Y, excl).reshape(S, D)
        if S > 1:
            up = np.maximum(excl, m.hop[X[:-1], x]) - self.bmax[:, None]
            down = np.maximum(excl, m.hop[x, X[1:]]) - self.bmax[:, None]
            dpp[1:] += up
            dpp[:-1] += down
        net = new_dp + 2 * (self.pp + dpp)
        for t in (s - 1, s + 1):  # neighbouring stages share boundaries with x: score them exactly
            if 0 <= t < S:
                net[t] = new_dp[t] + 2 * self._near_pp(s, p, t)
        net[s] = np.inf  # within a stage, the matchings re-pair pipelines
        return net, sec

    def _near_pp(self, s: int, p: int, t: int) -> np.ndarray:
        """PPcost after swapping X[s, p] with each X[t, q], t = s +- 1."""
        X, hop = self.X, self.m.hop
        S, D = X.shape
        x = X[s, p]
        row_s = np.repeat(X[s][None, :], D, axis=0)  # [q, :] the new row s
        row_s[:, p] = X[t]
        row_t = np.repeat(X[t][None, :], D, axis=0)
        row_t[np.arange(D), np.arange(D)] = x
        lo, hi = (s, t) if s < t else (t, s)
        r_lo, r_hi = (row_s, row_t) if s < t else (row_t, row_s)
        out = self.pp - self.bmax[lo]
        out = out + hop[r_lo, r_hi].max(axis=1)
        if lo > 0:
            out += hop[X[lo - 1][None, :], r_lo].max(axis=1) - self.bmax[lo - 1]
        if hi < S - 1:
            out += hop[r_hi, X[hi + 1][None, :]].max(axis=1) - self.bmax[hi]
        return out

    def _spare_swaps(self, s: int, p: int, excl: np.ndarray):
        new_s = self._row_s_with(s, p, self.Z)
        dpx = self.dpst.copy()
        dpx[s] = -np.inf
        other = dpx.max() if len(dpx) > 1 else -np.inf
        net = np.maximum(new_s, other) + 2 * (self.pp + self._x_side_pp(s, p, self.Z, excl))
        sec = self.sec - self.dpst[s] + new_s
        return net, sec

    # -- moves ----------------------------------------------------------------------------
    def _apply(self, s: int, p: int, kind: str, t: int, q: int) -> tuple[np.ndarray, np.ndarray]:
        X, Z = self.X.copy(), self.Z.copy()
        if kind == "spare":
            X[s, p], Z[t] = Z[t], X[s, p]
        else:
            X[s, p], X[t, q] = X[t, q], X[s, p]
        return X, Z

    def _candidates(self, s: int, p: int):
        """(net, sec, kind, t, q) arrays of every swap partner of X[s, p]."""
        X = self.X
        S, D = X.shape
        if S > 1:
            Hb = self.Hb
            arg = Hb.argmax(axis=1)
            H2 = Hb.copy()
            H2[np.arange(S - 1), arg] = -np.inf
            top2 = H2.max(axis=1)
            excl = np.where(np.arange(D)[None, :] == arg[:, None], top2[:, None], self.bmax[:, None])
        else:
            excl = np.zeros((0, D))
        net, sec = self._far_swaps(s, p, excl)
        nets, secs, kinds, ts, qs = [net.ravel()], [sec.ravel()], [np.zeros(S * D, np.int8)], \
            [np.repeat(np.arange(S), D)], [np.tile(np.arange(D), S)]
        if len(self.Z):
            net_z, sec_z = self._spare_swaps(s, p, excl)
            nets.append(net_z), secs.append(sec_z), kinds.append(np.ones(len(self.Z), np.int8))
            ts.append(np.arange(len(self.Z))), qs.append(np.zeros(len(self.Z), np.int64))
        return (np.concatenate(nets), np.concatenate(secs), np.concatenate(kinds),
                np.concatenate(ts), np.concatenate(qs))

    def _try_peer(self, s: int, p: int) -> bool:
        net, sec, kind, ts, qs = self._candidates(s, p)
        self.scored += len(net)
        if not self.m.extensions:
            better = (net < self.net - _EPS) | ((net <= self.net + _EPS) & (sec < self.sec - _EPS))
            if not better.any():
                return False
            idx = np.flatnonzero(better)
            k = idx[np.lexsort((sec[idx], net[idx]))[0]]
            self._load(*self._apply(s, p, "spare" if kind[k] else "swap", int(ts[k]), int(qs[k])))
            self.moves += 1
            return True
        order = np.lexsort((sec, net))
        picks = list(order[:_VERIFY])
        if self.m.memory_on or self.m.compute_on:  # spares change capacity and speed: check them all
            picks += [k for k in np.flatnonzero(kind == 1)[:64] if k not in picks]
        for k in picks:
            if not np.isfinite(net[k]):
                continue
            Xn, Zn = self._apply(s, p, "spare" if kind[k] else "swap", int(ts[k]), int(qs[k]))
            if self.m.breakdown(Xn).total_s < self.exact - _EPS:
                self._load(Xn, Zn)
                self.moves += 1
                return True
        return False

    def run(self, X: np.ndarray, Z: np.ndarray, max_sweeps: int = 50) -> tuple[np.ndarray, np.ndarray]:
        """Swap until a full sweep over all peers finds no gain (or time is up)."""
        self._load(X.copy(), Z.copy())
        S, D = X.shape
        for _ in range(max_sweeps):
            improved = False
            for pos in self.rng.permutation(S * D):
                if self.deadline():
                    return self.X, self.Z
                s, p = divmod(int(pos), D)
                improved |= self._try_peer(s, p)
            if not improved:
                break
        return self.X, self.Z
