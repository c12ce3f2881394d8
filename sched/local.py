"""Local search over allocations: swaps of two peers, or of a peer and a spare, scored incrementally.

For a chosen peer x (stage s, pipeline p) every swap partner y is scored at once with numpy:
the two changed DP groups from the groups' row sums (O(D) per candidate), the four changed
stage boundaries from each boundary's two largest hops, the rest of the objective unchanged.
Partners in the neighbouring stages (whose boundaries overlap x's) are scored from their
rebuilt boundaries, vectorised over pipelines. Within one stage, pipelines are re-paired by
the exact bottleneck matchings instead.

With the paper objective the incremental score is exact. With the extensions (compute, memory,
uneven layers) it screens: the best few candidates are re-scored exactly before one is taken.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .cost import CostModel, nearly_symmetric

__all__ = ["SwapSearch"]

_EPS = 1e-12
_VERIFY = 4  # candidates re-scored exactly per peer when the extensions are on


class SwapSearch:
    def __init__(self, model: CostModel, rng: np.random.Generator, deadline: Callable[[], bool]) -> None:
        self.m = model
        self.rng = rng
        self.deadline = deadline  # callable -> True when time is up
        self.symmetric = nearly_symmetric(model.dp_a) and nearly_symmetric(model.dp_b)
        self.moves = 0
        self.scored = 0

    # -- state ----------------------------------------------------------------------------
    def _load(self, X: np.ndarray, Z: np.ndarray) -> None:
        m = self.m
        self.X, self.Z = X, Z
        S, D = X.shape
        layers, _ = m.group_layers(X)
        self.g = np.array([m.workload.grad_gb(c) for c in layers])
        self.uniform = bool(np.all(self.g == self.g[0]))
        if self.uniform and getattr(self, "_w_g", None) != self.g[0]:
            self._w_g, self.W = self.g[0], m.dp_a + self.g[0] * m.dp_b  # (N, N) DP pair cost
        ix = (X[:, :, None], X[:, None, :])
        self.Wg = m.dp_a[ix] + self.g[:, None, None] * m.dp_b[ix]  # (S, D, D)
        self.R = self.Wg.sum(axis=2)  # (S, D)
        self.dpst = self.R.max(axis=1)
        self.Hb = m.hop[X[:-1], X[1:]]  # (S-1, D)
        self.bmax = self.Hb.max(axis=1) if S > 1 else np.zeros(0)
        self._totals()

    def _totals(self) -> None:
        self.pp = float(self.bmax.sum())
        self.net = float(self.dpst.max() + 2 * self.pp)
        self.hsum = float(self.Hb.sum())
        # secondary score, to move along plateaus of the max terms: every group's DP cost and
        # every hop count, not only the largest
        self.sec = float(self.dpst.sum()) + 2 * self.hsum / self.X.shape[1]
        self.exact = self.m.breakdown(self.X).total_s if self.m.extensions else self.net

    def _update(self, X: np.ndarray, Z: np.ndarray, rows: tuple[int, ...]) -> None:
        """Refresh the state after a move that changed only these rows (paper objective)."""
        if self.m.extensions:
            return self._load(X, Z)
        self.X, self.Z = X, Z
        S = X.shape[0]
        for r in set(rows):
            self.Wg[r] = self.W[np.ix_(X[r], X[r])]
            self.R[r] = self.Wg[r].sum(axis=1)
            self.dpst[r] = self.R[r].max()
            for b in (r - 1, r):
                if 0 <= b < S - 1:
                    self.Hb[b] = self.m.hop[X[b], X[b + 1]]
                    self.bmax[b] = self.Hb[b].max()
        self._totals()

    def _w_rows(self, rows: np.ndarray, g: float) -> np.ndarray:
        """(len(rows), N) DP pair costs from the given peers to every peer, at gradient g."""
        if self.uniform:
            return self.W[rows]
        return self.m.dp_a[rows] + g * self.m.dp_b[rows]

    def _w_cols(self, cols: np.ndarray, g: float) -> np.ndarray:
        """(N, len(cols)) DP pair costs from every peer to the given peers."""
        if self.uniform:
            return self.W[:, cols]
        return self.m.dp_a[:, cols] + g * self.m.dp_b[:, cols]

    # -- scoring --------------------------------------------------------------------------
    def _row_s_all(self, s: int, p: int) -> np.ndarray:
        """(N,) DP cost of group s when peer y (any index) replaces X[s, p]."""
        D = self.X.shape[1]
        if D == 1:
            return np.zeros(self.m.n)
        others = np.delete(np.arange(D), p)
        om = self.X[s, others]
        w_oy = self._w_rows(om, self.g[s])  # (D-1, N)
        members = (self.R[s, others] - self.Wg[s, others, p])[:, None] + w_oy
        own = w_oy.sum(axis=0) if self.symmetric else self._w_cols(om, self.g[s]).sum(axis=1)
        return np.maximum(members.max(axis=0), own)

    def _x_side_pp(self, s: int, p: int, Y: np.ndarray, excl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Change of PPcost, and of the sum of all hops, at boundaries s-1 and s when each y in
        Y replaces X[s, p]."""
        X, hop = self.X, self.m.hop
        S = X.shape[0]
        out = np.zeros(len(Y))
        hs = np.zeros(len(Y))
        if s > 0:
            h = hop[X[s - 1, p], Y]
            out += np.maximum(excl[s - 1, p], h) - self.bmax[s - 1]
            hs += h - self.Hb[s - 1, p]
        if s < S - 1:
            h = hop[Y, X[s + 1, p]]
            out += np.maximum(excl[s, p], h) - self.bmax[s]
            hs += h - self.Hb[s, p]
        return out, hs

    def _far_swaps(self, s: int, p: int, excl: np.ndarray, row_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scores (net, sec) of swapping x with every active peer (its own stage excluded)."""
        X, m = self.X, self.m
        S, D = X.shape
        x = X[s, p]
        Y = X.ravel()
        new_s = row_s[Y].reshape(S, D)
        if self.uniform:
            cx = self.W[:, x][X]  # W[X[t, m], x]
        else:
            cx = m.dp_a[:, x][X] + self.g[:, None] * m.dp_b[:, x][X]
        T = (self.R + cx)[:, None, :] - self.Wg.transpose(0, 2, 1)  # [t, q, m]
        T[:, np.arange(D), np.arange(D)] = -np.inf
        if self.symmetric:
            rx = cx
        else:
            rx = self.W[x][X] if self.uniform else m.dp_a[x][X] + self.g[:, None] * m.dp_b[x][X]
        new_t = np.maximum(T.max(axis=2), rx.sum(axis=1)[:, None] - rx)
        dpx = self.dpst.copy()
        dpx[s] = -np.inf
        i1 = int(np.argmax(dpx))
        v1 = dpx[i1]
        dpx[i1] = -np.inf
        v2 = dpx.max() if S > 2 else -np.inf
        other = np.where(np.arange(S) == i1, v2, v1)[:, None]
        new_dp = np.maximum(np.maximum(new_s, new_t), other)
        sec_dp = self.sec - 2 * self.hsum / D - self.dpst[s] - self.dpst[:, None] + new_s + new_t
        dpp, dhs = self._x_side_pp(s, p, Y, excl)
        dpp, dhs = dpp.reshape(S, D), dhs.reshape(S, D)
        if S > 1:
            h_up, h_down = m.hop[X[:-1], x], m.hop[x, X[1:]]
            dpp[1:] += np.maximum(excl, h_up) - self.bmax[:, None]
            dpp[:-1] += np.maximum(excl, h_down) - self.bmax[:, None]
            dhs[1:] += h_up - self.Hb
            dhs[:-1] += h_down - self.Hb
        net = new_dp + 2 * (self.pp + dpp)
        sec = sec_dp + 2 * (self.hsum + dhs) / D
        for t in (s - 1, s + 1):  # neighbouring stages share boundaries with x: score them exactly
            if 0 <= t < S:
                pp, hs = self._near_pp(s, p, t)
                net[t] = new_dp[t] + 2 * pp
                sec[t] = sec_dp[t] + 2 * hs / D
        net[s] = np.inf  # within a stage, the matchings re-pair pipelines
        return net, sec

    def _near_pp(self, s: int, p: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """PPcost and the sum of all hops after swapping X[s, p] with each X[t, q], t = s +- 1."""
        X, hop = self.X, self.m.hop
        S, D = X.shape
        x = X[s, p]
        row_s = np.repeat(X[s][None, :], D, axis=0)  # [q, :] the new row s
        row_s[:, p] = X[t]
        row_t = np.repeat(X[t][None, :], D, axis=0)
        row_t[np.arange(D), np.arange(D)] = x
        lo, hi = (s, t) if s < t else (t, s)
        r_lo, r_hi = (row_s, row_t) if s < t else (row_t, row_s)
        mid = hop[r_lo, r_hi]
        out = self.pp - self.bmax[lo] + mid.max(axis=1)
        hs = self.hsum - self.Hb[lo].sum() + mid.sum(axis=1)
        if lo > 0:
            h = hop[X[lo - 1][None, :], r_lo]
            out += h.max(axis=1) - self.bmax[lo - 1]
            hs += h.sum(axis=1) - self.Hb[lo - 1].sum()
        if hi < S - 1:
            h = hop[r_hi, X[hi + 1][None, :]]
            out += h.max(axis=1) - self.bmax[hi]
            hs += h.sum(axis=1) - self.Hb[hi].sum()
        return out, hs

    def _spare_swaps(self, s: int, p: int, excl: np.ndarray, row_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        new_s = row_s[self.Z]
        dpx = self.dpst.copy()
        dpx[s] = -np.inf
        other = dpx.max() if len(dpx) > 1 else -np.inf
        dpp, dhs = self._x_side_pp(s, p, self.Z, excl)
        net = np.maximum(new_s, other) + 2 * (self.pp + dpp)
        sec = self.sec - self.dpst[s] + new_s + 2 * dhs / self.X.shape[1]
        return net, sec

    # -- moves ----------------------------------------------------------------------------
    def _apply(self, s: int, p: int, kind: str, t: int, q: int) -> tuple[np.ndarray, np.ndarray]:
        X, Z = self.X.copy(), self.Z.copy()
        if kind == "spare":
            X[s, p], Z[t] = Z[t], X[s, p]
        else:
            X[s, p], X[t, q] = X[t, q], X[s, p]
        return X, Z

    def _candidates(self, s: int, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
        row_s = self._row_s_all(s, p)
        net, sec = self._far_swaps(s, p, excl, row_s)
        nets, secs, kinds, ts, qs = [net.ravel()], [sec.ravel()], [np.zeros(S * D, np.int8)], \
            [np.repeat(np.arange(S), D)], [np.tile(np.arange(D), S)]
        if len(self.Z):
            net_z, sec_z = self._spare_swaps(s, p, excl, row_s)
            nets.append(net_z)
            secs.append(sec_z)
            kinds.append(np.ones(len(self.Z), np.int8))
            ts.append(np.arange(len(self.Z)))
            qs.append(np.zeros(len(self.Z), np.int64))
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
            spare = bool(kind[k])
            X, Z = self._apply(s, p, "spare" if spare else "swap", int(ts[k]), int(qs[k]))
            self._update(X, Z, (s,) if spare else (s, int(ts[k])))
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

    def _critical(self) -> np.ndarray:
        """Positions (flat s * D + p) any strictly improving swap must move: the members of the
        costliest DP groups and both ends of every boundary's slowest hop."""
        S, D = self.X.shape
        cells = [np.flatnonzero(self.dpst >= self.dpst.max() - 1e-12)[:, None] * D + np.arange(D)]
        if S > 1:
            b, q = np.nonzero(self.Hb >= self.bmax[:, None] - 1e-12)
            cells += [b * D + q, (b + 1) * D + q]
        return np.unique(np.concatenate([c.ravel() for c in cells]))

    def _sweep(self, positions: np.ndarray) -> bool | None:
        """Try each position in random order; None when time ran out."""
        D = self.X.shape[1]
        improved = False
        for pos in self.rng.permutation(positions):
            if self.deadline():
                return None
            improved |= self._try_peer(*divmod(int(pos), D))
        return improved

    def run(self, X: np.ndarray, Z: np.ndarray, max_sweeps: int = 50,
            focus: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Swap until a full sweep over all peers finds no gain (or time is up).

        With the paper objective, sweeps over the critical peers alone come first (they are
        few, and only they can lower the cost); a full sweep then looks for swaps that lower
        the secondary score (the sum of the groups' DP costs and of all hops) before the next round.
        focus: peer indices; the full sweeps then visit only the positions of these peers (and
        the critical ones), where a perturbation of a few peers left its traces.
        """
        self._load(X.copy(), Z.copy())
        S, D = X.shape
        everyone = np.arange(S * D)
        for _ in range(max_sweeps):
            if not self.m.extensions:
                while True:
                    found = self._sweep(self._critical())
                    if found is None:
                        return self.X, self.Z
                    if not found:
                        break
            if focus is None:
                found = self._sweep(everyone)
            else:
                found = self._sweep(np.union1d(np.flatnonzero(np.isin(self.X.ravel(), focus)), self._critical()))
            if not found:
                break
        return self.X, self.Z
