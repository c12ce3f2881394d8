"""The rate limit of log lines about bad input (net/lograte.py), in virtual time."""

import pytest

from dtfm.net.lograte import LogLimiter


def test_one_line_per_key_per_interval_and_the_count_of_those_left_out():
    lim = LogLimiter(60.0, burst=10)
    assert lim.admit("1.2.3.4", 0.0) == 0  # the first line goes out
    assert [lim.admit("1.2.3.4", t) for t in (1.0, 30.0, 59.9)] == [None, None, None]
    assert lim.admit("5.6.7.8", 10.0) == 0  # another host has its own minute
    assert lim.admit("1.2.3.4", 60.0) == 3  # ... and says 3 were left out
    assert lim.admit("1.2.3.4", 61.0) is None
    assert lim.admit("1.2.3.4", 200.0) == 1


def test_a_flood_from_many_hosts_is_capped_overall():
    lim = LogLimiter(60.0, burst=3)
    logged = [lim.admit(f"10.0.0.{k}", 0.0) for k in range(10)]
    assert logged == [0, 0, 0] + [None] * 7
    assert lim.admit("10.0.0.9", 20.0) == 1  # a token back after 20 s (3 a minute)
    assert lim.admit("10.0.0.8", 20.0) is None


def test_the_key_table_is_bounded():
    lim = LogLimiter(1.0, burst=1000, max_keys=4)
    for k in range(100):
        lim.admit(k, 0.0)
    assert len(lim) == 4


@pytest.mark.parametrize("kwargs", [{"interval_s": 0}, {"interval_s": float("nan")},
                                    {"interval_s": 1, "burst": 0}, {"interval_s": 1, "max_keys": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        LogLimiter(**kwargs)
