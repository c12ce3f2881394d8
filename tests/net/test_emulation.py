"""Link emulation under MockClock: exact delivery times of the delay line and rate limiter."""

import random

import pytest
import trio

from dtfm.net.emulation import WIRE_OVERHEAD_BYTES, EmulatedLinks, EmulationConfig
from dtfm.scenarios import parse_scenario

SCENARIO = parse_scenario({
    "name": "two-sites",
    "region": [{"name": "A", "peers": 2, "delay_ms": 1, "bandwidth_gbps": 8},
               {"name": "B", "peers": 2, "delay_ms": 2, "bandwidth_gbps": 8}],
    "link": [{"a": "A", "b": "B", "delay_ms": 50, "bandwidth_gbps": 0.0008}],  # 100 kB/s
})
P1, P2 = b"\x01" * 32, b"\x02" * 32


class Sink:
    def __init__(self):
        self.got = []

    async def __call__(self, frame):
        self.got.append((trio.current_time(), frame))


async def open_link(nursery, shaper, peer, region):
    link = shaper.open_link(peer, region)
    sink = Sink()
    nursery.start_soon(link.run, sink)
    return link, sink


async def test_delay_line_delivers_after_one_way_delay(autojump_clock):
    shaper = EmulatedLinks(SCENARIO, "A", EmulationConfig())
    async with trio.open_nursery() as nursery:
        link, sink = await open_link(nursery, shaper, P1, "B")
        t0 = trio.current_time()
        await link.submit(b"x" * 10, False)
        await trio.sleep(0.01)
        await link.submit(b"y" * 10, False)
        await trio.sleep(1)
        assert [round(t - t0, 9) for t, _ in sink.got] == [0.05, 0.06]
        assert [f for _, f in sink.got] == [b"x" * 10, b"y" * 10]
        nursery.cancel_scope.cancel()


async def test_rate_limiter_spaces_frames_at_link_bandwidth(autojump_clock):
    cfg = EmulationConfig(burst_bytes=0)
    shaper = EmulatedLinks(SCENARIO, "A", cfg)
    async with trio.open_nursery() as nursery:
        link, sink = await open_link(nursery, shaper, P1, "B")
        t0 = trio.current_time()
        size = 1000 - WIRE_OVERHEAD_BYTES  # 1000 bytes on the wire: 10 ms at 100 kB/s
        for _ in range(5):
            await link.submit(b"z" * size, False)
        await trio.sleep(1)
        times = [round(t - t0, 9) for t, _ in sink.got]
        assert times == [0.06, 0.07, 0.08, 0.09, 0.10]  # serialisation, then 50 ms delay
        nursery.cancel_scope.cancel()


async def test_burst_credit_and_time_and_bandwidth_scales(autojump_clock):
    cfg = EmulationConfig(burst_bytes=2000, time_scale=2.0, bandwidth_scale=4.0)
    shaper = EmulatedLinks(SCENARIO, "A", cfg)
    delay_s, rate = shaper.link_figures("B")
    assert delay_s == pytest.approx(0.1) and rate == pytest.approx(100e3 * 4 / 2)
    async with trio.open_nursery() as nursery:
        link, sink = await open_link(nursery, shaper, P1, "B")
        await trio.sleep(10)  # idle: the bucket is full
        t0 = trio.current_time()
        for _ in range(4):
            await link.submit(b"z" * (1000 - WIRE_OVERHEAD_BYTES), False)
        await trio.sleep(1)
        # 2000 bytes of credit: two frames leave at once, then 5 ms apart (200 kB/s)
        assert [round(t - t0, 9) for t, _ in sink.got] == [0.1, 0.1, 0.105, 0.11]
        nursery.cancel_scope.cancel()


async def test_drop_fraction_only_hits_droppable_frames(autojump_clock):
    shaper = EmulatedLinks(SCENARIO, "A", EmulationConfig(drop_fraction=0.25), rng=random.Random(1))
    async with trio.open_nursery() as nursery:
        link, sink = await open_link(nursery, shaper, P1, "A")
        for i in range(400):
            await link.submit(b"d", True)
        for i in range(100):
            await link.submit(b"k", False)
        await trio.sleep(1)
        kept = [f for _, f in sink.got]
        assert kept.count(b"k") == 100
        assert 0.18 < 1 - kept.count(b"d") / 400 < 0.32
        shaper.set_drop_fraction(0.0)
        for i in range(50):
            await link.submit(b"e", True)
        await trio.sleep(1)
        assert [f for _, f in sink.got].count(b"e") == 50
        nursery.cancel_scope.cancel()


async def test_cut_and_heal_at_run_time(autojump_clock):
    a_side = EmulatedLinks(SCENARIO, "A")
    b_side = EmulatedLinks(SCENARIO, "B")
    async with trio.open_nursery() as nursery:
        ab, ab_sink = await open_link(nursery, a_side, P2, "B")
        ba, ba_sink = await open_link(nursery, b_side, P1, "A")
        a_side.cut(peer_id=P2)  # one direction: A -> B only
        await ab.submit(b"1", False)
        await ba.submit(b"2", False)
        await trio.sleep(1)
        assert ab_sink.got == [] and len(ba_sink.got) == 1
        a_side.heal()
        await ab.submit(b"3", False)
        # a cut while the frame is on the wire loses it
        await ba.submit(b"4", False)
        b_side.cut(region="A")
        await trio.sleep(1)
        assert [f for _, f in ab_sink.got] == [b"3"] and [f for _, f in ba_sink.got] == [b"2"]
        b_side.heal(region="A")
        await ba.submit(b"5", False)
        await trio.sleep(1)
        assert [f for _, f in ba_sink.got] == [b"2", b"5"]
        nursery.cancel_scope.cancel()


async def test_full_queue_applies_backpressure(autojump_clock):
    shaper = EmulatedLinks(SCENARIO, "A", EmulationConfig(queue_frames=2, burst_bytes=0))
    link = shaper.open_link(P2, "B")
    sink = Sink()
    await link.submit(b"a" * 980, False)
    await link.submit(b"b" * 980, False)
    with trio.move_on_after(5) as scope:
        await link.submit(b"c" * 980, False)  # nobody drains the link: waits
    assert scope.cancelled_caught
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run, sink)
        await link.submit(b"c" * 980, False)
        await trio.sleep(1)
        assert [f[:1] for _, f in sink.got] == [b"a", b"b", b"c"]
        nursery.cancel_scope.cancel()


async def test_shared_region_bandwidth_splits_the_uplink(autojump_clock):
    shaper = EmulatedLinks(SCENARIO, "A", EmulationConfig(burst_bytes=0, share_region_bandwidth=True))
    async with trio.open_nursery() as nursery:
        l1, s1 = await open_link(nursery, shaper, P1, "B")
        l2, s2 = await open_link(nursery, shaper, P2, "B")
        t0 = trio.current_time()
        await l1.submit(b"a" * 980, False)
        await l2.submit(b"b" * 980, False)
        await trio.sleep(1)
        assert round(s1.got[0][0] - t0, 9) == 0.06 and round(s2.got[0][0] - t0, 9) == 0.07
        nursery.cancel_scope.cancel()


def test_config_validation_and_unknown_regions():
    with pytest.raises(ValueError):
        EmulationConfig(time_scale=0)
    with pytest.raises(ValueError):
        EmulationConfig(drop_fraction=1.5)
    with pytest.raises(KeyError):
        EmulatedLinks(SCENARIO, "Mars")
    assert EmulatedLinks(SCENARIO, "A").link_figures("Mars") == (0.0, float("inf"))
