"""Verification under load: a member whose acks come after the ping's deadline, or who answers
nothing for a while, is still confirmed (sans-IO `Swim`, virtual time).

A 64-daemon swarm on one machine left members unconfirmed for minutes: on a loaded host, and
with verification pings queued behind bandwidth probes on slow emulated links, the acks came
6-7 s after pings whose deadline was 5 s, every attempt missed, and only the regular probes
were left to verify them (one per member in 64 probe intervals, each ack late as well)."""

import heapq
import random

from dtfm.gossip.claims import Claim
from dtfm.gossip.config import GossipConfig
from dtfm.gossip.members import MemberState
from dtfm.gossip.messages import Ack, Ping, PushPull
from dtfm.gossip.swim import LATE_ACK_FACTOR, MAX_VERIFY_BACKOFF_S, Swim
from dtfm.net import Identity

ALIVE = MemberState.ALIVE
# no regular probe within the tests' windows: only verification pings confirm
CFG = GossipConfig.lan().with_(push_pull_interval_s=0.0, probe_interval_s=1e4, probe_timeout_s=1.0)
RNG = random.Random(5)
ME, JOINER, OTHER = (Identity(RNG.randbytes(32)) for _ in range(3))


def claim(identity, k):
    return Claim.create(identity, 0, ALIVE, "10.0.0.%d" % k, 7000, "eu")


def observer(cfg=CFG):
    return Swim(cfg, ME, claim(ME, 1).member(), random.Random(1), 0.0)


def run(s, sends, answer, until):
    """Drive `s` in virtual time until `until`: each verification ping to the joiner is given
    to `answer(sent_at)`, which returns when its ack arrives (None: never)."""
    acks: list[tuple[float, int]] = []
    t = 0.0

    def post(out, now):
        for x in out:
            if x.dial and isinstance(x.msg, Ping) and x.to == JOINER.peer_id:
                at = answer(now)
                if at is not None:
                    heapq.heappush(acks, (at, x.msg.seq))

    post(sends, t)
    while t < until and not s.is_confirmed(JOINER.peer_id):
        t = min(s.next_deadline(), acks[0][0] if acks else float("inf"), until)
        while acks and acks[0][0] <= t:
            _, seq = heapq.heappop(acks)
            post(s.handle(JOINER.peer_id, Ack(seq), t), t)
        post(s.tick(t), t)
    return t


def joined(s):
    return s.handle(JOINER.peer_id, PushPull((claim(JOINER, 2),), reply=False), 0.0, origin="10.0.0.2")


def test_acks_later_than_the_deadline_still_confirm():
    s = observer()
    late = 1.5 * CFG.verify_timeout_s  # every ack comes after its ping's deadline
    t = run(s, joined(s), lambda sent: sent + late, until=60.0)
    assert s.is_confirmed(JOINER.peer_id)
    assert t == late  # by the first ping's own ack
    assert s.live_count() == 2


def test_an_ack_past_the_late_window_or_from_another_peer_confirms_nobody():
    s = observer()
    pings = [x for x in joined(s) if x.dial]
    assert len(pings) == 1
    nonce = pings[0].msg.seq
    expired = CFG.verify_timeout_s * (1 + LATE_ACK_FACTOR) + 0.01
    s.tick(CFG.verify_timeout_s)  # the ping expires; its nonce stays answerable for a while
    s.handle(OTHER.peer_id, Ack(nonce), CFG.verify_timeout_s + 0.1)  # not the pinged member
    assert not s.is_confirmed(JOINER.peer_id)
    s.tick(expired)
    s.handle(JOINER.peer_id, Ack(nonce), expired)
    assert not s.is_confirmed(JOINER.peer_id)


def test_a_member_silent_through_its_attempts_is_verified_again_after_a_back_off():
    s = observer()
    quiet_until = CFG.verify_attempts * CFG.verify_timeout_s + 1.0  # every attempt goes unanswered
    t = run(s, joined(s), lambda sent: sent + 0.01 if sent >= quiet_until else None, until=600.0)
    assert s.is_confirmed(JOINER.peer_id)
    # attempts, then one back-off of attempts x timeout, then an answered ping
    assert t <= 2 * CFG.verify_attempts * CFG.verify_timeout_s + 0.1


def test_back_offs_double_up_to_the_cap_while_a_fake_never_answers():
    s = observer()
    sent = []
    run(s, joined(s), lambda at: sent.append(at), until=3600.0)
    assert not s.is_confirmed(JOINER.peer_id)
    rounds = [sent[i] for i in range(0, len(sent), CFG.verify_attempts)]
    gaps = [b - a for a, b in zip(rounds, rounds[1:])]
    burst = CFG.verify_attempts * CFG.verify_timeout_s  # a round's own attempts
    waits = [g - burst for g in gaps]
    assert waits[0] == burst and waits[1] == 2 * burst  # the back-off doubles
    assert max(waits) == MAX_VERIFY_BACKOFF_S and waits[-1] == MAX_VERIFY_BACKOFF_S
    # at the cap, a round of attempts per MAX_VERIFY_BACKOFF_S: an hour of a fake costs 73 dials
    assert len(sent) <= CFG.verify_attempts * (3600 / MAX_VERIFY_BACKOFF_S + 7)
