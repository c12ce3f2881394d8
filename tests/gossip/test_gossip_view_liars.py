"""The network view against members that lie: what each link's figure can and cannot become.

Every holder of the swarm key is a member we do not control. The view's guarantee: for a link
an honest end measured, the delay is at least that end's figure and the bandwidth at most, so
lying can only make the liar's own links look worse; links between honest members are within
their measurement noise of the truth.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.gossip.records import MAX_GBPS, MAX_RTT_MS, Entry, RecordStore, Report
from dtfm.gossip.service import offer_all
from dtfm.gossip.sync import RecordSync, RecordSyncer, SyncPhase, SyncRole, SyncStep
from dtfm.gossip.view import DISAGREEMENT_RATIO, build_view
from dtfm.net.identity import Identity

NOW = 1.8e9
NOISE = 0.1  # honest figures are within 10% of the truth
IDS = [Identity(bytes([i + 1]) * 32) for i in range(8)]


def everyone(peer_id):
    return True


def honest_row(i, n, rtt, bw, seq=10):
    entries = [Entry(IDS[j].peer_id, rtt[i, j], bw[i, j], 5) for j in range(n) if j != i]
    return Report.create(IDS[i], seq, NOW, 1.0, entries)


def forged(liar, victim, seq, entries, compute_ms=0.01):
    """A report claiming to be victim's, signed with the liar's key."""
    unsigned = Report(victim.peer_id, seq, NOW, compute_ms, tuple(sorted(entries, key=lambda e: e.target)))
    return Report(unsigned.measurer, seq, NOW, compute_ms, unsigned.entries, liar.sign(unsigned.signing_bytes()))


def noisy_truth(rng, n):
    true_rtt = rng.uniform(1, 500, (n, n))
    true_rtt = (true_rtt + true_rtt.T) / 2
    true_bw = np.exp(rng.uniform(np.log(0.01), np.log(100), (n, n)))
    true_bw = (true_bw + true_bw.T) / 2
    rtt = true_rtt * rng.uniform(1 - NOISE, 1 + NOISE, (n, n))
    bw = true_bw * rng.uniform(1 - NOISE, 1 + NOISE, (n, n))
    return true_rtt, true_bw, rtt, bw


def test_a_selective_liar_cannot_make_its_link_faster():
    """6 peers; the liar is honest about 3 of its 5 links and claims a true 10 ms / 0.1 Gbps
    round trip to be 60 s / 1000 Gbps. A median of its biases stays near zero, so a view
    that trusts low-bias ends took the geometric mean: 775 ms and 10 Gbps."""
    n, liar, victim = 6, 0, 1
    rtt = np.full((n, n), 50.0)
    bw = np.full((n, n), 1.0)
    rtt[liar, victim] = rtt[victim, liar] = 10.0
    bw[liar, victim] = bw[victim, liar] = 0.1
    rtt[liar, [victim, 2]] = MAX_RTT_MS
    bw[liar, [victim, 2]] = MAX_GBPS
    view = build_view([i.peer_id for i in IDS[:n]], {IDS[i].peer_id: honest_row(i, n, rtt, bw) for i in range(n)})
    assert view.bandwidth_gbps[liar, victim] == view.bandwidth_gbps[victim, liar] == 0.1
    assert view.delay_ms[liar, victim] == MAX_RTT_MS / 2  # worse, as the liar wished: work moves away
    assert (IDS[liar].peer_id, IDS[victim].peer_id) in view.disputed_links()
    assert view.as_dict()["disputed"] == [[IDS[liar].peer_id.hex(), IDS[k].peer_id.hex()] for k in (1, 2)]
    honest = np.ix_(range(1, n), range(1, n))
    assert np.all(view.delay_ms[honest][~np.eye(n - 1, dtype=bool)] == 25.0)


def test_a_report_counts_only_under_its_own_measurer():
    n = 3
    rtt, bw = np.full((n, n), 40.0), np.full((n, n), 2.0)
    reports = {IDS[i].peer_id: honest_row(i, n, rtt, bw) for i in range(n)}
    lie = Report.create(IDS[2], 11, NOW, 0.01, [Entry(IDS[0].peer_id, 0.5, MAX_GBPS, 5),
                                                Entry(IDS[1].peer_id, 0.5, MAX_GBPS, 5)])
    reports[IDS[0].peer_id] = lie  # filed under peer 0, signed by peer 2
    view = build_view([i.peer_id for i in IDS[:n]], reports)
    assert view.delay_ms[0, 1] == 20.0 and view.bandwidth_gbps[0, 1] == 2.0  # peer 1's figure alone
    assert view.one_sided[0, 1] and np.isnan(view.compute_ms[0])


figure_rtt = st.one_of(st.sampled_from([1e-3, 1.0, MAX_RTT_MS]), st.floats(1e-3, MAX_RTT_MS))
figure_bw = st.one_of(st.sampled_from([0.0, 1e-3, MAX_GBPS]), st.floats(0.0, MAX_GBPS))


@st.composite
def lies(draw, n, liar):
    """A liar's claims: its own row (any subset of its links, any figures) and rows it forges
    in other members' names (any links, its own or not)."""
    others = [j for j in range(n) if j != liar]
    own = [Entry(IDS[j].peer_id, draw(figure_rtt), draw(figure_bw), 5)
           for j in draw(st.lists(st.sampled_from(others), unique=True))]
    forgeries = []
    for victim in draw(st.lists(st.sampled_from(others), unique=True, max_size=2)):
        targets = draw(st.lists(st.sampled_from([j for j in range(n) if j != victim]), unique=True))
        entries = [Entry(IDS[j].peer_id, draw(figure_rtt), draw(figure_bw), 5) for j in targets]
        forgeries.append(forged(IDS[liar], IDS[victim], draw(st.integers(0, 20)), entries))
    return [Report.create(IDS[liar], 10, NOW, 0.01, own)] + forgeries


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_liars_cannot_make_a_link_with_an_honest_end_look_better(data):
    n = data.draw(st.integers(3, 7), label="peers")
    liars = data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1), label="liars")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    true_rtt, true_bw, rtt, bw = noisy_truth(rng, n)
    offered = [honest_row(i, n, rtt, bw) for i in range(n) if i not in liars]
    for liar in sorted(liars):
        offered += data.draw(lies(n, liar), label=f"lies of {liar}")
    store = RecordStore(skew_s=600)
    for r in data.draw(st.permutations(offered), label="arrival order"):
        store.offer(r, now_wall=NOW, is_member=everyone)
    view = build_view([i.peer_id for i in IDS[:n]], store.reports)
    for i in range(n):
        if i not in liars:
            assert store.reports[IDS[i].peer_id] == offered[[r.measurer for r in offered].index(IDS[i].peer_id)]
            assert view.compute_ms[i] == 1.0
        for j in range(n):
            honest_ends = [k for k in (i, j) if k not in liars]
            if i == j or not honest_ends:
                continue
            d, b = view.delay_ms[i, j] * 2, view.bandwidth_gbps[i, j]
            for h in honest_ends:
                other = j if h == i else i
                assert d >= rtt[h, other] and b <= bw[h, other]  # never better than an honest end
            assert d >= true_rtt[i, j] * (1 - NOISE) and b <= true_bw[i, j] * (1 + NOISE)
            if len(honest_ends) == 2:  # two honest ends: the worse of theirs, within noise of the truth
                assert d == max(rtt[i, j], rtt[j, i]) and b == min(bw[i, j], bw[j, i])
                assert abs(d / true_rtt[i, j] - 1) <= NOISE and abs(b / true_bw[i, j] - 1) <= NOISE
                assert not view.disputed[i, j]
            else:
                h, liar = (i, j) if i not in liars else (j, i)
                claim = {e.target: e for e in store.reports[IDS[liar].peer_id].entries}.get(IDS[h].peer_id)
                if claim is not None and max(claim.rtt_ms / rtt[h, liar], rtt[h, liar] / claim.rtt_ms) > DISAGREEMENT_RATIO:
                    assert view.disputed[i, j]


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, r):
        self.calls += 1
        return r.verify()


async def test_a_hostile_member_forges_floods_lies_and_replays_and_the_honest_view_holds():
    n, liar = 5, 4
    rng = np.random.default_rng(7)
    _, _, rtt, bw = noisy_truth(rng, n)
    old = [honest_row(i, n, rtt / 10, bw * 10, seq=5) for i in range(liar)]  # when links were fast
    honest = [honest_row(i, n, rtt, bw) for i in range(liar)]
    verify = Counting()
    store = RecordStore(skew_s=600, verify=verify)
    for r in honest:
        store.offer(r, now_wall=NOW, is_member=everyone)
    syncer = RecordSyncer(store, max_sync_bytes=1 << 20, timeout_s=10.0)
    fast = [Entry(IDS[j].peer_id, 0.01, MAX_GBPS, 5) for j in range(liar)]
    own = [Report.create(IDS[liar], seq, NOW, 0.01, fast) for seq in range(1, 1001)]  # lies, newest last
    forgeries = [forged(IDS[liar], IDS[v], 11, [e for e in fast if e.target != IDS[v].peer_id])
                 for v in range(liar)]
    flood = own + old * 200 + forgeries * 500  # 3,800 reports
    liar_id, before = IDS[liar].peer_id, verify.calls
    assert syncer.handle(liar_id, RecordSync(SyncStep.HASH, b"\x00" * 16, (), ()), 0.0).reply is not None
    actions = syncer.handle(liar_id, RecordSync(SyncStep.OFFER, b"", (), tuple(flood)), 0.0)
    assert syncer.phase(liar_id, SyncRole.RESPONDER) is SyncPhase.IDLE
    reasons = await offer_all(store, actions.accept, now_wall=NOW, is_member=everyone)
    assert verify.calls - before == 1 + liar  # its newest own row and one forgery per victim
    assert reasons == [None] + ["bad signature"] * liar
    assert [store.reports[IDS[i].peer_id] for i in range(liar)] == honest  # no forgery, no replay
    assert store.reports[liar_id].seq == 1000
    view = build_view([i.peer_id for i in IDS[:n]], store.reports)
    for h in range(liar):
        assert view.delay_ms[h, liar] * 2 == rtt[h, liar] and view.bandwidth_gbps[h, liar] == bw[h, liar]
        assert view.disputed[h, liar]
        for k in range(liar):
            if k != h:
                assert view.delay_ms[h, k] * 2 == max(rtt[h, k], rtt[k, h]) and not view.disputed[h, k]
    # Sent again: nothing is newer than held, so nothing more is verified.
    syncer.handle(liar_id, RecordSync(SyncStep.HASH, b"\x00" * 16, (), ()), 1.0)
    again = syncer.handle(liar_id, RecordSync(SyncStep.OFFER, b"", (), tuple(flood)), 1.0)
    assert again.accept == tuple(forgeries)
    await offer_all(store, again.accept, now_wall=NOW, is_member=everyone)
    assert verify.calls - before == 1 + 2 * liar


def test_a_links_rate_in_bytes_per_second_or_none_where_unknown():
    from dtfm.gossip.view import NetworkView

    a, b, c, stranger = b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 32
    bw = np.array([[np.inf, 0.8, np.nan], [0.4, np.inf, 1.0], [np.nan, 1.0, np.inf]])
    view = NetworkView((a, b, c), np.zeros((3, 3)), bw, np.full(3, np.nan), complete=False)
    assert view.link_bytes_per_s(a, b) == 0.8e9 / 8 and view.link_bytes_per_s(b, a) == 0.4e9 / 8  # src -> dst
    assert view.link_bytes_per_s(a, c) is None  # unmeasured
    assert view.link_bytes_per_s(a, a) is None and view.link_bytes_per_s(stranger, a) is None
