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
    # a spare at 100 MB takes on stage 0 of 2 x 2 (150 MB) and holds it, growing to 170 MB at
    # 300 s: 6.25 % over 160 s of that tenure; briefly a bigger stage of 2 x 1 (200 MB), then
    # stage 0 of 2 x 2 again, too short a tenure to judge (samples of separate tenures are
    # never compared: the first ended at 300 s)
    series = [(0, 100 * MB, None), (40, 100 * MB, None), (100, 150 * MB, (2, 2, 0)), (140, 160 * MB, (2, 2, 0)),
              (300, 170 * MB, (2, 2, 0)), (310, 200 * MB, (2, 1, 0)), (500, 171 * MB, (2, 2, 0)),
              (600, 176 * MB, (2, 2, 0))]
    growth, worst = _soak({("p00", 7): series}).growth_in_kind()
    assert growth == 0.0625 and worst == {"p00/7": ["(2, 2, 0)", 160, 170, 160]}


def test_a_spare_again_after_holding_a_stage_is_not_compared_with_the_spare_it_was():
    # an hour's soak: p00 was a spare at 63 MB (no torch yet), held stage 1 of 2 x 1, and was a
    # spare again at 370 MB (torch loaded, its stage freed): two spare tenures, each flat
    series = [(0, 63 * MB, None), (40, 63 * MB, None), (200, 63 * MB, None), (210, 380 * MB, (2, 1, 1)),
              (400, 390 * MB, (2, 1, 1)), (410, 370 * MB, None), (450, 370 * MB, None), (700, 371 * MB, None)]
    growth, worst = _soak({("p00", 3965): series}).growth_in_kind()
    assert growth == round(371 / 370 - 1, 4) and worst["p00/3965"][:3] == ["None", 370, 371]


def test_a_kind_held_for_less_than_the_span_is_not_judged():
    series = [(0, 100 * MB, (2, 2, 1)), (40, 100 * MB, (2, 2, 1)), (100, 300 * MB, (2, 2, 1))]
    assert _soak({("p01", 9): series}).growth_in_kind() == (None, {})


def test_growth_compares_the_largest_samples_of_the_first_and_last_window():
    # a stage whose resident memory swings between steps (150 MB between, 190 MB within a step):
    # a first sample between steps and a last within one are not a 27 % leak; the windows'
    # largest samples (190, 195) are what grew
    series = [(0, 100 * MB, (2, 2, 0)), (30, 150 * MB, (2, 2, 0)), (45, 190 * MB, (2, 2, 0)), (100, 170 * MB, (2, 2, 0)),
              (160, 160 * MB, (2, 2, 0)), (190, 195 * MB, (2, 2, 0))]
    growth, worst = _soak({("p02", 5): series}).growth_in_kind()
    assert growth == round(195 / 190 - 1, 4) and worst["p02/5"][1:3] == [190, 195]


def test_a_spare_that_becomes_the_coordinator_starts_a_tenure():
    # a spare at 365 MB becomes the coordinator and loads the scheduler (417 MB), flat after:
    # two tenures, each flat, not 14 % of growth
    spare = {"role": "follower", "stage": None}
    coordinator = {"role": "coordinator", "stage": None}
    series = [(t, 365 * MB, bench.kind_held(spare)) for t in range(0, 400, 20)] + [
        (t, 417 * MB, bench.kind_held(coordinator)) for t in range(400, 800, 20)]
    growth, worst = _soak({("p03", 24508): series}).growth_in_kind()
    assert growth == 0.0
    stage = {"role": "follower", "stages": 2, "dp": 1, "stage": 0}
    assert bench.kind_held(stage) == ((2, 1, 0), False, False) != bench.kind_held({**stage, "role": "coordinator"})


def test_a_spare_that_loads_the_data_set_with_its_first_allocation_starts_a_tenure():
    # A restarted spare (288 MB) loads the data set when its first allocation comes (+33 MB),
    # flat after: the data set is what it holds now, not growth of what it held.
    spare = {"role": "follower", "stage": None}
    series = [(t, 288 * MB, bench.kind_held(spare)) for t in range(0, 200, 10)] + [
        (t, 321 * MB, bench.kind_held({**spare, "data_bytes": 32_126_760})) for t in range(200, 600, 10)]
    growth, worst = _soak({("p00", 4324): series}).growth_in_kind()
    assert growth == 0.0 and list(worst) == ["p00/4324"]


def test_a_restarted_daemon_waiting_without_its_stage_is_not_the_tenure_of_that_stage():
    # A daemon restarted into the allocation it applied before names its stage but holds none
    # (280 MB) until a new epoch gives it the stage back (400 MB, flat): two tenures, not 43 %.
    stage = {"role": "follower", "stages": 2, "dp": 1, "stage": 0}
    waiting = {**stage, "restored": True}
    series = [(t, 280 * MB, bench.kind_held(waiting)) for t in range(0, 200, 10)] + [
        (t, 400 * MB, bench.kind_held(stage)) for t in range(200, 400, 10)]
    growth, worst = _soak({("p06", 4263): series}).growth_in_kind()
    assert growth == 0.0 and bench.kind_held(waiting) != bench.kind_held(stage)
