import math

import numpy as np
import pytest

from dtfm.scenarios import ScenarioError, builtin_scenarios, load_scenario, parse_scenario


def test_builtin_scenarios_load_with_paper_peer_counts():
    assert builtin_scenarios() == ["datacenter", "regional", "spot", "universities", "worldwide"]
    for name in builtin_scenarios():
        s = load_scenario(name)
        assert s.n_peers == 64
        d, b = s.delay_ms(), s.bandwidth_gbps()
        assert d.shape == b.shape == (64, 64)
        assert np.array_equal(d, d.T) and np.array_equal(b, b.T)
        assert np.all(np.diag(d) == 0) and np.all(np.isinf(np.diag(b)))


def test_worldwide_links_and_region_order():
    s = load_scenario("worldwide")
    regions = s.peer_regions()
    assert regions[:8] == ["Oregon"] * 8 and regions[8] == "Virginia"
    assert s.link("Oregon", "Virginia") == s.link("Virginia", "Oregon")
    d = s.delay_ms()
    assert d[0, 1] == 5 and d[0, 8] == s.link("Oregon", "Virginia")[0]


def test_defaults_fill_missing_links():
    s = load_scenario("spot")
    assert s.link("spot-0", "spot-3") == (0.0, 1.25)
    assert s.link("standalone", "standalone") == (0.0, 1.25)
    assert s.bandwidth_gbps()[0, 1] == 100


def test_scaled_keeps_proportions_and_every_region():
    s = load_scenario("spot")  # 8 regions of 4 and one of 32
    small = s.scaled(16)
    assert small.n_peers == 16
    counts = {r.name: r.peers for r in small.regions}
    assert all(c >= 1 for c in counts.values())
    assert counts["standalone"] == max(counts.values())
    w = load_scenario("worldwide").scaled(16)
    assert [r.peers for r in w.regions] == [2] * 8
    assert load_scenario("worldwide").scaled(3).n_peers == 3


@pytest.mark.parametrize("data, message", [
    ({"region": [{"name": "a", "peers": 1, "delay_ms": 1, "bandwidth_gbps": 1}]}, "missing scenario name"),
    ({"name": "x", "region": [{"name": "a", "peers": -1, "delay_ms": 1, "bandwidth_gbps": 1}]}, "peers"),
    ({"name": "x", "region": [{"name": "a", "peers": 1, "delay_ms": math.nan, "bandwidth_gbps": 1}]}, "delay_ms"),
    ({"name": "x", "region": [{"name": "a", "peers": 1, "delay_ms": 1, "bandwidth_gbps": 0}]}, "bandwidth_gbps"),
    ({"name": "x", "region": [{"name": "a", "peers": 1, "delay_ms": 1, "bandwidth_gbps": 1},
                              {"name": "b", "peers": 1, "delay_ms": 1, "bandwidth_gbps": 1}]}, "no link"),
    ({"name": "x", "region": [{"name": "a", "peers": 1, "delay_ms": 1, "bandwidth_gbps": 1}],
      "link": [{"a": "a", "b": "z", "delay_ms": 1, "bandwidth_gbps": 1}]}, "unknown region"),
])
def test_bad_scenarios_are_refused_with_a_reason(data, message):
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(data)


def test_unknown_name_lists_the_builtins(tmp_path):
    with pytest.raises(ScenarioError, match="worldwide"):
        load_scenario("nowhere")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(bad)
