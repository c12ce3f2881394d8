import pytest

from dtfm.net.ratelimit import HandshakeAdmission, TokenBuckets


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


def test_admission_caps_half_open_and_rate():
    adm = HandshakeAdmission(rate_per_s=1.0, burst=2, max_half_open=3)
    assert adm.admit("x", 0.0) is None
    assert adm.admit("x", 0.0) is None
    assert "rate limit" in adm.admit("x", 0.0)
    assert adm.admit("y", 0.0) is None
    assert "in progress" in adm.admit("z", 0.0)
    adm.finished()
    assert adm.admit("z", 0.0) is None
    assert adm.half_open == 3


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_bad_parameters(args):
    with pytest.raises(ValueError):
        HandshakeAdmission(*args)
