"""Matchings, the open path and the whole search against brute force on small instances."""

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtfm.sched import CommSpec, bottleneck_matching, open_path, solve


def brute_bottleneck(m):
    n = m.shape[0]
    return min(max(m[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))


def brute_path(E):
    n = E.shape[0]
    return min(sum(E[p[k], p[k + 1]] for k in range(n - 1)) for p in itertools.permutations(range(n)))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**32 - 1), st.booleans())
def test_bottleneck_matching_is_optimal(n, seed, ties):
    rng = np.random.default_rng(seed)
    m = rng.integers(0, 4, (n, n)).astype(float) if ties else rng.random((n, n))
    value, cols = bottleneck_matching(m)
    assert sorted(cols.tolist()) == list(range(n))
    assert max(m[i, cols[i]] for i in range(n)) == value
    assert value == brute_bottleneck(m)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(0, 2**32 - 1), st.booleans())
def test_open_path_is_optimal(n, seed, symmetric):
    rng = np.random.default_rng(seed)
    E = rng.random((n, n))
    if symmetric:
        E = E + E.T
    cost, order = open_path(E)
    assert sorted(order) == list(range(n))
    assert abs(sum(E[order[k], order[k + 1]] for k in range(n - 1)) - cost) < 1e-9
    assert abs(cost - brute_path(E)) < 1e-9


def test_path_heuristic_beyond_the_exact_limit_is_close():
    rng = np.random.default_rng(3)
    E = rng.random((9, 9))
    E = E + E.T
    exact, _ = open_path(E)
    approx, order = open_path(E, exact_max_nodes=4)
    assert sorted(order) == list(range(9))
    assert approx <= exact * 1.10


# -- the whole search --------------------------------------------------------------------------

def network(rng, n):
    """Peers in 3 random sites with random links: ties and structure, like real swarms."""
    site = rng.integers(0, 3, n)
    base = rng.random((3, 3)) * 150
    base = (base + base.T) / 2
    delay = base[site][:, site] + rng.random((n, n)) * 10
    delay = (delay + delay.T) / 2
    bw = 0.3 + rng.random((n, n)) * 2
    bw = (bw + bw.T) / 2
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bw, np.inf)
    return delay, bw


def weights(delay, bw, S, D, g, act):
    n = delay.shape[0]
    a = delay / 1e3
    inv = np.where(np.eye(n, dtype=bool), 0.0, 8 / bw)
    return 2 * (a + g * inv / D), a + act * inv


def brute_by_permutation(delay, bw, S, D, g, act):
    """Every assignment of the peers to (stage, pipeline) slots, scored at once."""
    W, H = weights(delay, bw, S, D, g, act)
    X = np.array(list(itertools.permutations(range(S * D))), dtype=np.int64).reshape(-1, S, D)
    dp = W[X[:, :, :, None], X[:, :, None, :]].sum(-1).max(axis=(1, 2))
    pp = H[X[:, :-1], X[:, 1:]].max(axis=2).sum(axis=1)
    return float((dp + 2 * pp).min())


def brute_3x4(delay, bw, g, act):
    """Every partition of 12 peers into 3 groups of 4; each boundary's best pairing by brute
    force over the 24 pairings; the best of the 3 stage orders (which group sits in the middle)."""
    W, H = weights(delay, bw, 3, 4, g, act)
    perms = np.array(list(itertools.permutations(range(4))))
    best = np.inf
    rest0 = list(range(1, 12))
    for tail in itertools.combinations(rest0, 3):
        A = (0,) + tail
        left = [p for p in rest0 if p not in tail]
        for tail2 in itertools.combinations(left[1:], 3):
            B = (left[0],) + tail2
            C = tuple(p for p in left if p not in B)
            groups = [np.array(A), np.array(B), np.array(C)]
            dp = max(W[np.ix_(grp, grp)].sum(axis=1).max() for grp in groups)

            def bott(x, y):
                return H[x[None, :], y[perms]].max(axis=1).min()  # over pairings of y with x

            ab, bc, ac = bott(groups[0], groups[1]), bott(groups[1], groups[2]), bott(groups[0], groups[2])
            best = min(best, dp + 2 * min(ab + bc, ab + ac, ac + bc))
    return best


# derandomize: the examples are the same on every run, so the suite is repeatable (the search is
# deterministic for a seed and a generation cap).
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([(2, 4), (4, 2)]))
def test_search_finds_the_optimum_of_8_peers(seed, shape):
    S, D = shape
    rng = np.random.default_rng(seed)
    delay, bw = network(rng, 8)
    spec = CommSpec("t", layers=3 * S, grad_gb_total=0.65 * S, act_gb_global=0.47 * D)
    alloc = solve(delay, bw, spec, stages=S, dp=D, seed=seed % 1000, generations=8, time_budget_s=60)
    assert abs(alloc.cost.paper_s - brute_by_permutation(delay, bw, S, D, 0.65, 0.47)) < 1e-9


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_search_finds_the_optimum_of_12_peers_as_3x4(seed):
    rng = np.random.default_rng(seed)
    delay, bw = network(rng, 12)
    spec = CommSpec("t", layers=9, grad_gb_total=0.65 * 3, act_gb_global=0.47 * 4)
    alloc = solve(delay, bw, spec, stages=3, dp=4, seed=seed % 1000, generations=30, time_budget_s=60)
    assert abs(alloc.cost.paper_s - brute_3x4(delay, bw, 0.65, 0.47)) < 1e-9
