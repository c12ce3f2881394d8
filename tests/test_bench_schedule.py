"""bench/schedule.py: what it refuses, and its summary of the schedule A/B."""

import pytest
from bench_modules import load_bench

bench = load_bench("schedule")


def test_bad_arguments_are_refused_before_any_swarm_starts(capsys):
    for argv in (["--methods", "cocktail"], ["--rounds", "0"], ["--steps", "2"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    assert "--methods from exact, slow-link" in capsys.readouterr().err


def test_spread_gives_mean_and_range():
    assert bench.spread([1.0, 2.0, 4.5]) == {"mean": 2.5, "min": 1.0, "max": 4.5}
