"""bench/soak.py's judgement of memory: growth while a daemon holds the same kind of stage (a
leak) apart from growth by taking a bigger stage on."""

from bench_modules import load_bench

bench = load_bench("soak")
MB = 1 << 20


def _soak(held):
    s = bench.Soak.__new__(bench.Soak)
    s.held = held
    return s


def test_a_spare_that_takes_a_stage_on_is_no_leak_and_growth_in_one_kind_is():
    # a spare at 100 MB takes on stage 0 of 2 x 2 (150 MB), holds it, briefly holds a bigger
    # stage of 2 x 1 (200 MB), and back in 2 x 2 ends at 176 MB: 10 % over 460 s in that kind
    series = [(0, 100 * MB, None), (40, 100 * MB, None), (100, 150 * MB, (2, 2, 0)), (140, 160 * MB, (2, 2, 0)),
              (300, 170 * MB, (2, 2, 0)), (310, 200 * MB, (2, 1, 0)), (500, 171 * MB, (2, 2, 0)),
              (600, 176 * MB, (2, 2, 0))]
    growth, worst = _soak({("p00", 7): series}).growth_in_kind()
    assert growth == 0.1 and worst == {"p00/7": ["(2, 2, 0)", 160, 176, 460]}


def test_a_kind_held_for_less_than_the_span_is_not_judged():
    series = [(0, 100 * MB, (2, 2, 1)), (40, 100 * MB, (2, 2, 1)), (100, 300 * MB, (2, 2, 1))]
    assert _soak({("p01", 9): series}).growth_in_kind() == (None, {})
