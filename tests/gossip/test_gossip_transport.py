"""GossipService over the real encrypted transport on loopback, links shaped by the emulator.
Real time, bounded; the measured figures are checked against physical bounds only (the
emulator adds delay and limits rate; the precise oracle runs under MockClock in
test_gossip_service.py)."""

import random

import numpy as np
import pytest
import trio

from dtfm.gossip import GossipConfig, GossipService, MemberState
from dtfm.net import EmulatedLinks, EmulationConfig, Identity, Transport, TransportConfig
from dtfm.scenarios import parse_scenario

KEY = bytes(range(32))
# Rates low enough that a loaded 2-core machine encrypts and moves a probe faster than the
# emulator lets it through: the figures measure the emulated links, not the CPU left over.
SCENARIO = parse_scenario({
    "name": "two-sites",
    "region": [{"name": "A", "peers": 2, "delay_ms": 10, "bandwidth_gbps": 0.06},
               {"name": "B", "peers": 2, "delay_ms": 10, "bandwidth_gbps": 0.06}],
    "link": [{"a": "A", "b": "B", "delay_ms": 30, "bandwidth_gbps": 0.02}],
})
CFG = GossipConfig.local().with_(bandwidth_probe_bytes=1024 * 1024, bandwidth_probe_interval_s=0.05,
                                 rtt_samples=3, rtt_ping_spacing_s=0.01, publish_interval_s=0.3,
                                 record_sync_interval_s=0.3, max_sync_bytes=32 * 1024)


async def wait_for(pred, limit_s):
    with trio.fail_after(limit_s):
        while not pred():
            await trio.sleep(0.05)


@pytest.mark.slow
async def test_gossip_over_real_transport_with_emulated_links():
    regions = ["A", "A", "B", "B"]
    services = []
    async with trio.open_nursery() as nursery:
        for k, region in enumerate(regions):
            shaper = EmulatedLinks(SCENARIO, region, EmulationConfig(), rng=random.Random(k))
            t = Transport(Identity.generate(), KEY, TransportConfig.test(), region=region, shaper=shaper)
            await nursery.start(t.serve, "127.0.0.1", 0)
            svc = GossipService(t, t.identity, CFG, region=region, rng=random.Random(k), compute_ms=1.0)
            await nursery.start(svc.run)
            services.append(svc)
        for svc in services[1:]:
            assert await svc.join([services[0].transport.listen_address]) == 1
        await wait_for(lambda: all(s.swim.live_count() == 4 for s in services), 10)
        await wait_for(lambda: all(s.view().pairs_measured() == 12 for s in services), 30)  # every link measured
        view = services[0].view()
        index = {s.identity.peer_id: k for k, s in enumerate(services)}
        order = [index[p] for p in view.peers]
        want_d = SCENARIO.delay_ms()[np.ix_(order, order)]
        want_b = SCENARIO.bandwidth_gbps()[np.ix_(order, order)]
        off = ~np.eye(4, dtype=bool)
        ratio_d = view.delay_ms[off] / want_d[off]
        ratio_b = view.bandwidth_gbps[off] / want_b[off]
        assert np.all(ratio_d > 0.9) and np.all(ratio_d < 5.0), ratio_d
        assert np.all(ratio_b > 0.3) and np.all(ratio_b < 1.5), ratio_b
        rows = services[0].status()["members"]
        assert {r["region"] for r in rows} == {"A", "B"}
        # kill one peer's transport: the others declare it dead
        victim = services[3]
        await victim.transport.aclose()
        await wait_for(lambda: all(s.swim.members[victim.identity.peer_id].state == MemberState.DEAD
                                   for s in services[:3]), 30)
        nursery.cancel_scope.cancel()
