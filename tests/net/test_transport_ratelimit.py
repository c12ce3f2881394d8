import math
import random
from collections import OrderedDict

import pytest

from dtfm.gossip.admission import admission_buckets
from dtfm.net.budget import PayloadBudget
from dtfm.net.lograte import LogLimiter
from dtfm.net.ratelimit import HandshakeAdmission, TokenBuckets, source_key
from dtfm.net.replay import HelloGuard
from dtfm.peer.ratelimit import SourceRate


def test_token_bucket_burst_then_rate():
    b = TokenBuckets(rate_per_s=2.0, burst=3)
    assert [b.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert b.allow("b", 0.0)  # other addresses unaffected
    assert not b.allow("a", 0.4)
    assert b.allow("a", 0.5)  # 0.5 s * 2/s = one token
    assert not b.allow("a", 0.5)
    assert [b.allow("a", 100.0) for _ in range(4)] == [True, True, True, False]  # capped at burst


def test_token_bucket_table_is_bounded():
    b = TokenBuckets(rate_per_s=1.0, burst=1, max_keys=3)
    for i in range(10):
        b.allow(f"h{i}", 0.0)
    assert len(b) == 3


@pytest.mark.parametrize("host, key", [
    ("10.0.0.1", "10.0.0.1"),
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("::ffff:10.0.0.1", "10.0.0.1"),
    ("fe80::1%eth0", "fe80::/64"),
    ("server", "server"),
])
def test_sources_count_by_host_and_ipv6_by_64(host, key):
    assert source_key(host) == key


def test_admission_caps_half_open_and_rate():
    adm = HandshakeAdmission(rate_per_s=1.0, burst=2, max_half_open=3)
    assert adm.admit("x", 0.0) is None
    assert adm.admit("x", 0.0) is None
    assert "rate limit" in adm.admit("x", 0.0)
    assert adm.admit("y", 0.0) is None
    assert "in progress" in adm.admit("z", 0.0)
    adm.finished("y")
    assert adm.admit("z", 0.0) is None
    assert adm.half_open == 3


def test_half_open_per_source_and_one_ipv6_64_is_one_source():
    adm = HandshakeAdmission(rate_per_s=100.0, burst=100, max_half_open=10, max_half_open_per_host=2)
    assert adm.admit("2001:db8::1", 0.0) is None
    assert adm.admit("2001:db8::2", 0.0) is None
    assert "from 2001:db8::/64" in adm.admit("2001:db8::ffff:3", 0.0)  # same /64: its share is taken
    assert adm.admit("2001:db8:0:1::1", 0.0) is None  # the next /64 is another source
    adm.finished("2001:db8::1")
    assert adm.admit("2001:db8::7", 0.0) is None
    assert adm.half_open == 3


def test_pending_connections_capped_per_source_and_overall():
    adm = HandshakeAdmission(rate_per_s=1.0, burst=1, max_half_open=1, max_pending=3, max_pending_per_host=2)
    assert adm.arrive("a") is None and adm.arrive("a") is None
    assert "from a" in adm.arrive("a")
    assert adm.arrive("b") is None
    assert "awaiting their hello (3)" in adm.arrive("c")
    adm.left("a")
    assert adm.arrive("c") is None
    assert adm.pending == 3 and adm.half_open == 0  # waiting for a hello holds no handshake slot


def test_token_bucket_is_taken_by_hellos_only():
    adm = HandshakeAdmission(rate_per_s=1.0, burst=1, max_half_open=4, max_pending=100, max_pending_per_host=100)
    for _ in range(50):  # connections that never send a hello cost the source no tokens
        assert adm.arrive("x") is None
        adm.left("x")
    assert adm.admit("x", 0.0) is None
    assert "rate limit" in adm.admit("x", 0.0)


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_bad_parameters(args):
    with pytest.raises(ValueError):
        HandshakeAdmission(*args)
    with pytest.raises(ValueError):
        HandshakeAdmission(1, 1, 1, max_pending=0)


# ---- hello freshness ----------------------------------------------------------------------------


def test_hello_guard_window_and_replay():
    g = HelloGuard(skew_s=60)
    assert g.check(b"m1", 1000.0, 1000.0) is None
    assert g.check(b"m1", 1000.0, 1001.0) == "replayed hello"
    assert "ago" in g.check(b"m2", 939.0, 1000.0)
    assert "future" in g.check(b"m3", 1061.0, 1000.0)
    assert g.check(b"m4", 940.0, 1000.0) is None and g.check(b"m5", 1060.0, 1000.0) is None
    assert "ago" in g.check(b"m1", 1000.0, 1061.0)  # out of the window: refused by its time
    assert len(g) == 1  # m1 and m4 expired, m5 is still inside the window


def test_hello_guard_stays_bounded_and_never_forgets_into_a_replay():
    g = HelloGuard(skew_s=60, max_entries=3)
    for i in range(3):
        assert g.check(bytes([i]), 100.0 + i, 100.0) is None
    assert g.check(bytes([9]), 110.0, 100.0) is None  # full: the oldest (t=100) is forgotten
    assert len(g) == 3 and g.floor == 100.0
    assert g.check(bytes([0]), 100.0, 100.0) == "hello older than the replay record reaches"
    assert g.check(bytes([1]), 101.0, 100.0) == "replayed hello"
    assert g.check(b"new", 100.5, 100.0) == "hello older than the replay record reaches"  # full: floor 101
    assert g.check(b"newer", 120.0, 100.0) is None and g.floor == 101.0 and len(g) == 3


def test_payload_budget():
    b = PayloadBudget(100)
    assert b.reserve(60) and not b.reserve(41) and b.reserve(40)
    assert b.used_bytes == 100
    b.release(100)
    assert b.used_bytes == 0
    with pytest.raises(ValueError):
        b.release(1)


# ---- one token bucket for every per-key limit ---------------------------------------------------
# The limits built on TokenBuckets (the daemon's per-source requests, gossip's new members, the
# log of refused input) against the separate implementations they replaced, run side by side on
# random sequences. Times and rates are binary fractions, so both do exact arithmetic.

class _LruBuckets:
    """Tokens per key, least recently used forgotten first (peer/ratelimit.py's SourceRate)."""

    def __init__(self, rate_per_s, burst, max_keys):
        self.rate, self.burst, self.max_keys = rate_per_s, burst, max_keys
        self.buckets = OrderedDict()

    def allow(self, key, now):
        tokens, at = self.buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self.buckets[key] = (tokens, now)
        while len(self.buckets) > self.max_keys:
            self.buckets.popitem(last=False)
        return allowed


class _FullestBuckets:
    """Tokens per key with grants, the fullest forgotten first (gossip's AdmissionLimiter)."""

    def __init__(self, rate_per_s, burst, max_keys):
        self.rate, self.burst, self.max_keys = rate_per_s, burst, max_keys
        self.buckets = {}

    def tokens(self, key, now):
        tokens, at, until = self.buckets.get(key, (float(self.burst), now, float("-inf")))
        if now <= until:
            return tokens
        return min(float(self.burst), tokens + (now - at) * self.rate)

    def take(self, key, now):
        tokens = self.tokens(key, now)
        until = self.buckets.get(key, (0.0, 0.0, float("-inf")))[2]
        self.buckets[key] = (max(0.0, tokens - 1.0), now, until)
        if len(self.buckets) > self.max_keys:
            del self.buckets[max(self.buckets, key=lambda k: self.tokens(k, now))]

    def grant(self, key, tokens, now, duration_s):
        self.buckets[key] = (max(float(tokens), self.tokens(key, now)), now, now + duration_s)


class _LogGate:
    """One line per key per interval, `burst` overall (net/lograte.py's LogLimiter)."""

    def __init__(self, interval_s, burst, max_keys):
        self.interval_s, self.burst, self.max_keys = interval_s, burst, max_keys
        self.keys = OrderedDict()
        self.tokens, self.tokens_at = float(burst), None

    def admit(self, key, now):
        last, left_out = self.keys.pop(key, (-math.inf, 0))
        allowed = now - last >= self.interval_s and self._take(now)
        self.keys[key] = (now, 0) if allowed else (last, left_out + 1)
        while len(self.keys) > self.max_keys:
            self.keys.popitem(last=False)
        return left_out if allowed else None

    def _take(self, now):
        if self.tokens_at is not None:
            self.tokens = min(float(self.burst),
                              self.tokens + max(0.0, now - self.tokens_at) * self.burst / self.interval_s)
        self.tokens_at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


def _times(rng, n):
    now, out = 0.0, []
    for _ in range(n):
        now += rng.choice((0.0, 0.0, 0.125, 0.25, 0.5, 1.0, 4.0))
        out.append(now)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_daemons_source_rate_is_the_buckets_it_replaced(seed):
    rng = random.Random(seed)
    rate, burst, keys = rng.choice((0.5, 1.0, 2.0)), rng.randint(1, 4), rng.randint(1, 5)
    new, old = SourceRate(rate, burst, max_sources=keys), _LruBuckets(rate, burst, keys)
    for now in _times(rng, 400):
        key = bytes([rng.randrange(8)])
        assert new.allow(key, now) == old.allow(key, now)
        assert len(new) == len(old.buckets)


@pytest.mark.parametrize("seed", range(20))
def test_gossips_admission_is_the_buckets_it_replaced(seed):
    rng = random.Random(seed)
    rate, burst, keys = rng.choice((0.0, 0.5, 1.0)), rng.randint(0, 4), rng.randint(1, 5)
    new, old = admission_buckets(rate, burst, keys), _FullestBuckets(rate, burst, keys)
    for now in _times(rng, 400):
        key = rng.randrange(8)
        op = rng.random()
        if op < 0.05:
            new.grant(key, 16, now, 2.0)
            old.grant(key, 16, now, 2.0)
        elif op < 0.5:
            new.take(key, now)
            old.take(key, now)
        assert new.tokens(key, now) == old.tokens(key, now)
        assert len(new) == len(old.buckets)


@pytest.mark.parametrize("seed", range(20))
def test_the_refusal_log_limit_is_the_gate_it_replaced(seed):
    rng = random.Random(seed)
    interval, burst, keys = rng.choice((0.5, 1.0, 2.0)), rng.randint(1, 4), rng.randint(1, 5)
    new, old = LogLimiter(interval, burst=burst, max_keys=keys), _LogGate(interval, burst, keys)
    for now in _times(rng, 400):
        key = rng.randrange(8)
        assert new.admit(key, now) == old.admit(key, now)
        assert len(new) == len(old.keys)


def test_a_token_bucket_table_forgets_the_oldest_or_the_fullest():
    oldest = TokenBuckets(rate_per_s=1.0, burst=2, max_keys=2)
    fullest = TokenBuckets(rate_per_s=1.0, burst=2, max_keys=2, evict="fullest")
    for b in (oldest, fullest):
        b.take("a", 0.0)
        b.take("a", 0.0)  # empty
        b.take("b", 0.0)  # one left
        b.take("c", 0.0)  # a third key: one goes
    assert oldest.tokens("a", 0.0) == 2.0  # "a" was the oldest: forgotten, full again
    # the fullest ("b" and "c" hold one each; "b" came first) went: "a", empty, stays empty
    assert [fullest.tokens(k, 0.0) for k in "abc"] == [0.0, 2.0, 1.0]
    forgotten = []
    tracked = TokenBuckets(rate_per_s=1.0, burst=1, max_keys=1, on_forget=forgotten.append)
    tracked.allow("x", 0.0)
    tracked.touch("y", 0.0)
    assert forgotten == ["x"] and len(tracked) == 1
    with pytest.raises(ValueError):
        TokenBuckets(rate_per_s=float("nan"), burst=1)
    with pytest.raises(ValueError):
        TokenBuckets(rate_per_s=1.0, burst=1, evict="newest")
