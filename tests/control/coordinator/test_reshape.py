"""The coordinator's reshape: the next allocation when the swarm changes, on synthetic views of a few sites."""

import numpy as np
import pytest

from dtfm.control.coordinator.reshape import CUT_PENALTY_S, KINDS, ReshapePlan, default_stage_bytes, relabel_pipelines, reshape
from dtfm.control.coordinator.schedule import sched_spec, view_matrices
from dtfm.gossip import NetworkView
from dtfm.sched import SEARCH_PROFILES, CostModel, simulate_iteration, solve
from dtfm.train import GPTSpec, Plan, TrainConfig

# Activations outweigh gradients (long sequences, a narrow model): more pipelines pay off when
# the links allow it, so growing can be predicted faster.
SPEC = GPTSpec("act-heavy", n_layer=4, n_embd=256, n_head=4, seq_len=1024)
CFG = TrainConfig(global_batch_seqs=64, micro_batches=4)
SEARCH = SEARCH_PROFILES["test"]  # repeatable: capped generations, ample time
INTRA, INTER = (1.0, 4.0), (15.0, 1.0)  # (one-way ms, Gbps) inside a site and between sites
RANGES = ((0, 1), (1, 2), (2, 3), (3, 4))


def pid(i: int) -> bytes:
    return bytes([i + 1]) * 32


def sites(counts, slow=(), factor=10.0):
    """Peers 0.. in sites of the given sizes; links between the peers of `slow` `factor` x slower
    (delay up, bandwidth down)."""
    site = np.array([k for k, c in enumerate(counts) for _ in range(c)])
    n = len(site)
    same = site[:, None] == site[None, :]
    delay = np.where(same, INTRA[0], INTER[0])
    bw = np.where(same, INTRA[1], INTER[1])
    for a in slow:
        for b in slow:
            if a != b:
                delay[a, b] *= factor
                bw[a, b] /= factor
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bw, np.inf)
    ids = tuple(pid(i) for i in range(n))
    return NetworkView(ids, delay, bw, np.full(n, np.nan), True), {p: f"site{k}" for p, k in zip(ids, site)}


def current(*pipes) -> Plan:
    return Plan(tuple(tuple(pid(i) for i in p) for p in pipes), RANGES)


def plan(view, regions, cur, live=None, **kw) -> ReshapePlan:
    live = frozenset(view.peers if live is None else live)
    kw.setdefault("remaining_steps", 1000)
    p = reshape(view, SPEC, CFG, current=cur, live=live, regions=regions, config=SEARCH, **kw)
    placed = {peer for pipe in p.placement.pipelines for peer in pipe}
    assert placed <= live and not placed & set(p.placement.spares)  # a dead peer is never placed
    assert set(p.placement.spares) == (live & set(view.peers)) - placed
    assert p.kind in KINDS and any(c["chosen"] and c["kind"] == p.kind for c in p.candidates)
    return p


def idx(p: ReshapePlan):
    return [[p_[0] - 1 for p_ in pipe] for pipe in p.placement.pipelines]


def moves_oracle(cur: Plan, pipelines, ranges) -> int:
    """Peers whose new layer range is not the one they held."""
    held = {peer: cur.layer_ranges[s] for pipe in cur.pipelines for s, peer in enumerate(pipe)}
    return sum(held.get(peer) != ranges[s] for pipe in pipelines for s, peer in enumerate(pipe))


def test_first_allocation_is_the_scheduler():
    view, regions = sites([4, 4, 4])
    p = plan(view, regions, None, stages=4, dp=2)
    assert p.kind == "reschedule" and p.moves == 0 and p.bytes_moved == 0
    assert p.placement.layer_ranges == RANGES
    assert sorted(sorted(pipe) for pipe in idx(p)) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a site per pipeline


def test_dead_peer_with_a_spare_is_repaired_with_one_move():
    view, regions = sites([4, 5])  # peer 8 in the second site is a spare
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    p = plan(view, regions, cur, live=set(view.peers) - {pid(6)})
    assert p.kind == "repair" and p.moves == 1
    assert idx(p) == [[0, 1, 2, 3], [4, 5, 8, 7]]
    assert p.bytes_moved == default_stage_bytes(SPEC)((2, 3))
    assert p.fetches == ((pid(8), (2, 3), pid(2)),)  # from the one live holder of stage 2
    assert p.move_s > 0 and not p.lost_ranges


def test_dead_peer_without_spares_shrinks_with_no_move():
    view, regions = sites([4, 4])
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    p = plan(view, regions, cur, live=set(view.peers) - {pid(5)})
    assert p.kind == "shrink" and p.moves == 0 and p.bytes_moved == 0 and p.move_s == 0
    assert idx(p) == [[0, 1, 2, 3]]  # the whole pipeline keeps its stages
    assert sorted(p.placement.spares) == [pid(4), pid(6), pid(7)]


def test_three_of_four_holders_dead_restages():
    view, regions = sites([5])
    cur = current([0, 1, 2, 3])
    p = plan(view, regions, cur, live={pid(0), pid(4)})
    assert p.kind == "restage"
    S = len(p.placement.layer_ranges)
    assert S < 4 and p.placement.layer_ranges[0][0] == 0 and p.placement.layer_ranges[-1][1] == SPEC.n_layer
    assert set(p.lost_ranges) <= {(1, 2), (2, 3), (3, 4)} and p.lost_ranges  # only a checkpoint has them
    assert all(c["kind"] == "restage" for c in p.candidates)
    assert p.moves == moves_oracle(cur, p.placement.pipelines, p.placement.layer_ranges)


def test_joined_peers_grow_when_faster():
    view, regions = sites([4, 4])
    cur = current([0, 1, 2, 3])
    p = plan(view, regions, cur)
    assert p.kind == "grow" and p.moves == 4
    assert idx(p)[0] == [0, 1, 2, 3] and sorted(idx(p)[1]) == [4, 5, 6, 7]
    keep = next(c for c in p.candidates if c["kind"] == "keep")
    assert p.placement.predicted_iteration_s < keep["predicted_s"] * 0.9
    assert p.gain_s == pytest.approx((keep["predicted_s"] - p.placement.predicted_iteration_s) * 1000)


def test_joined_peers_stay_spares_when_growing_is_slower():
    view, regions = sites([4, 4], slow=range(4, 8), factor=10)  # the new site's links are poor
    cur = current([0, 1, 2, 3])
    p = plan(view, regions, cur)
    assert p.kind == "keep" and p.moves == 0 and idx(p) == [[0, 1, 2, 3]]
    assert sorted(p.placement.spares) == [pid(i) for i in range(4, 8)]
    grow = [c for c in p.candidates if c["kind"] == "grow"]
    assert grow and all(c["predicted_s"] > p.placement.predicted_iteration_s for c in grow)


def test_small_drift_keeps():
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])  # site 2 (peers 8..11) is spare
    view, regions = sites([4, 4, 4], slow=range(4, 8), factor=1.05)
    p = plan(view, regions, cur)
    assert p.kind == "keep" and p.moves == 0 and p.gain_s == 0
    # something faster exists, by less than min_gain: hysteresis, not blindness, keeps
    keep_s = p.placement.predicted_iteration_s
    assert any(keep_s * 0.9 < c["predicted_s"] < keep_s for c in p.candidates)


def test_small_drift_forced_reschedules():
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    view, regions = sites([4, 4, 4], slow=range(4, 8), factor=1.05)
    p = plan(view, regions, cur, force=True)
    assert p.kind != "keep" and p.gain_s > 0
    assert p.placement.predicted_iteration_s < next(c for c in p.candidates if c["kind"] == "keep")["predicted_s"]


def test_large_drift_reschedules_with_few_moves():
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    view, regions = sites([4, 4, 4], slow=range(4, 8), factor=10)  # pipeline 1's links 10x slower
    p = plan(view, regions, cur)
    assert p.kind == "reschedule"
    assert p.moves == 4 == moves_oracle(cur, p.placement.pipelines, p.placement.layer_ranges)
    assert idx(p)[0] == [0, 1, 2, 3] and sorted(idx(p)[1]) == [8, 9, 10, 11]  # site 2 replaces pipeline 1
    assert sorted(p.placement.spares) == [pid(i) for i in range(4, 8)]
    assert p.gain_s > p.move_s > 0


def test_large_drift_with_no_steps_left_keeps():
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    view, regions = sites([4, 4, 4], slow=range(4, 8), factor=10)
    assert plan(view, regions, cur, remaining_steps=0).kind == "keep"  # no step to gain on


def test_warm_reschedule_moves_fewer_peers_than_a_fresh_solve():
    # after one change (a pipeline's links slowed), the warm-started reschedule against the
    # scheduler run afresh on the same live peers, moves counted the same way
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    view, regions = sites([4, 4, 4], slow=range(4, 8), factor=10)
    warm = plan(view, regions, cur, force=True)
    delay, bw = view_matrices(view)
    fresh = solve(delay, bw, sched_spec(SPEC, CFG, 2), stages=4, dp=2, regions=[regions[p] for p in view.peers],
                  seed=0, config=SEARCH)
    fresh_moves = moves_oracle(cur, [[view.peers[i] for i in pipe] for pipe in fresh.pipelines], RANGES)
    assert warm.moves == 4 and fresh_moves >= 2 * warm.moves
    assert warm.placement.objective_s <= fresh.cost.paper_s + 1e-9


@pytest.mark.parametrize("seed", range(5))
def test_relabelling_never_changes_the_prediction(seed):
    view, _ = sites([4, 4, 4])
    rng = np.random.default_rng(seed)
    delay, bw = view_matrices(view)
    model = CostModel(delay, bw, sched_spec(SPEC, CFG, 3).workload(4, 3))
    X = rng.permutation(12)[:12].reshape(4, 3)
    Y = X[:, rng.permutation(3)]
    R = relabel_pipelines(Y, X)
    assert (R == X).all()  # the original order is found again
    for Z in (Y, R):
        assert simulate_iteration(model, Z, micro_batches=CFG.micro_batches, engine_syncs=True).iteration_s == \
            pytest.approx(simulate_iteration(model, X, micro_batches=CFG.micro_batches, engine_syncs=True).iteration_s)
        assert model.total(Z) == pytest.approx(model.total(X))


def test_relabelling_with_a_different_width():
    X = np.array([[5, 1, 9], [6, 2, 10]])  # (S=2, D=3)
    old = np.array([[1, -1], [2, 3]])  # (S=2, D=2), a dead peer as -1
    R = relabel_pipelines(X, old)
    assert R[:, 0].tolist() == [1, 2] and sorted(R.ravel()) == sorted(X.ravel())


def test_errors():
    view, _ = sites([4, 4])
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    bad = NetworkView(view.peers, np.where(np.eye(8, dtype=bool), 0, np.nan), view.bandwidth_gbps, view.compute_ms,
                      False)
    with pytest.raises(ValueError, match="incomplete"):
        reshape(bad, SPEC, CFG, current=cur, live=frozenset(view.peers), remaining_steps=10)
    with pytest.raises(ValueError, match="no live peer"):
        reshape(view, SPEC, CFG, current=cur, live=frozenset({b"x" * 32}), remaining_steps=10)
    with pytest.raises(ValueError, match="layers"):
        reshape(view, SPEC, CFG, current=Plan(cur.pipelines, ((0, 1), (1, 2), (2, 3), (3, 5))),
                live=frozenset(view.peers), remaining_steps=10)
    with pytest.raises(ValueError, match="too small|micro-batches"):
        reshape(view, SPEC, TrainConfig(global_batch_seqs=2, micro_batches=4), current=cur,
                live=frozenset(view.peers), remaining_steps=10)


def test_summary_names_every_candidate():
    view, regions = sites([4, 5])
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    p = plan(view, regions, cur, live=set(view.peers) - {pid(6)})
    line = p.summary()
    assert line.startswith("reshape: repair 4x2") and line.count(";") == len(p.candidates) - 1
    assert {"kind", "shape", "predicted_s", "moves", "bytes", "move_s", "score"} <= set(p.candidates[0])


def test_a_cut_link_is_routed_around_with_a_spare():
    # peers 1 and 2 (stages 1 and 2 of the first pipeline) answer, not each other; 8 is a spare
    from dtfm.control.coordinator.links import used_cut_links
    view, regions = sites([4, 5])
    cur = current([0, 1, 2, 3], [4, 5, 6, 7])
    cut = [(pid(1), pid(2))]
    p = plan(view, regions, cur, cut_links=cut)
    assert p.kind != "keep" and used_cut_links(p.placement.pipelines, cut) == []
    assert p.placement.predicted_iteration_s < CUT_PENALTY_S
    keep = next(c for c in p.candidates if c["kind"] == "keep")
    assert keep["predicted_s"] >= CUT_PENALTY_S  # the current layout over the cut link


def test_a_cut_link_no_layout_avoids_costs_every_candidate_the_penalty():
    view, regions = sites([4])
    p = plan(view, regions, current([0, 1, 2, 3]), cut_links=[(pid(0), pid(3))])  # one pipeline: all pairs talk
    assert p.placement.predicted_iteration_s >= CUT_PENALTY_S


def test_a_per_link_run_reschedules_on_the_live_peers_with_their_own_codec_speeds():
    """A compressed run's options carry a coding speed per view peer; the scheduler run on the
    live ones alone gets theirs (a swarm stopped its run on "codec speeds of 8 peers, the
    network has 7" when a peer refused a reshape)."""
    from dtfm.control.coordinator.schedule import compression_options_of
    from dtfm.train.compress import parse_compression

    view, regions = sites([4, 4])
    opts = compression_options_of(parse_compression("auto"), view=view)
    assert len(opts.peer_speeds) == len(view.peers)
    gone = pid(6)
    p = plan(view, regions, current([0, 1, 2, 3], [4, 5, 6, 7]), live=set(view.peers) - {gone},
             compression=opts, force=True)
    assert gone not in {peer for pipe in p.placement.pipelines for peer in pipe}
    assert any(c["kind"] in ("reschedule", "restage") for c in p.candidates)
    sub = opts.of_peers([0, 2, 5])
    assert sub.peer_speeds == tuple(opts.peer_speeds[i] for i in (0, 2, 5)) and sub.pp == opts.pp
