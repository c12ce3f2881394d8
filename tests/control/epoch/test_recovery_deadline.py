"""A stage fetch's chunk deadlines follow the link to the holder: a stage crosses a link too slow
for a flat deadline, and a stalled holder on a fast link is still dropped at the flat one
(in-memory network, trio's MockClock)."""

from __future__ import annotations

import pytest
import trio

from dtfm.control.epoch.recovery import (
    MIN_LINK_BYTES_PER_S,
    UNKNOWN_LINK_BYTES_PER_S,
    RecoveryError,
    RecoveryServer,
    chunk_deadline_s,
    fetch_stage,
)
from dtfm.control.epoch.runner import params_sha256
from dtfm.net import Identity, MemNetwork, TransportConfig, uniform_link

from test_recovery import CFG, CHUNK, LAYERS, LIMIT, RUN, SPEC, STEP, anyone, make_state

SLOW_BPS = 1e6  # bits per second: four chunks of 64 KiB queued on it take 2.1 s
TIMEOUT_S = 1.0


def test_the_deadline_adds_the_bytes_ahead_at_a_share_of_the_link():
    mib = 1 << 20
    gigabit = 125e6  # bytes/s
    assert TIMEOUT_S < chunk_deadline_s(TIMEOUT_S, gigabit, 4 * mib) < TIMEOUT_S + 0.2
    assert chunk_deadline_s(10.0, 250e3, 4 * mib) == pytest.approx(10.0 + 4 * mib / (250e3 / 4))
    # queued chunks count: a chunk behind three others is given four chunks' time
    assert chunk_deadline_s(10.0, 250e3, 4 * mib) - 10.0 == pytest.approx(4 * (chunk_deadline_s(10.0, 250e3, mib)
                                                                              - 10.0))
    assert chunk_deadline_s(10.0, None, mib) == pytest.approx(10.0 + mib / UNKNOWN_LINK_BYTES_PER_S)
    assert chunk_deadline_s(10.0, 0.0, mib) == chunk_deadline_s(10.0, None, mib)
    # a lying report of a crawling link bounds the wait
    assert chunk_deadline_s(10.0, 1.0, mib) == pytest.approx(10.0 + mib / MIN_LINK_BYTES_PER_S)


class HangingServer(RecoveryServer):
    async def _on_chunk(self, conn, msg_type, body, payload):
        await trio.sleep_forever()


async def one_holder(nursery: trio.Nursery, bps: float, server_cls=RecoveryServer):
    """A fetcher and one holder of `make_state()` on an in-memory link of `bps`."""
    net = MemNetwork(uniform_link(0.05, bps), config=TransportConfig.test())
    me = net.add(Identity.generate().peer_id, "eu")
    holder = net.add(Identity.generate().peer_id, "us")
    server = server_cls(holder, chunk_bytes=CHUNK, authorize=anyone)
    await nursery.start(net.run)
    await nursery.start(me.serve)
    await nursery.start(holder.serve)
    state = make_state()
    offer = await server.offer(RUN, state)
    return me, holder, offer, state


async def fetch(me, holder, digest: str, **kw):
    return await fetch_stage(me, [(holder.peer_id, holder.listen_address)], run_id=RUN, step=STEP,
                             layer_range=LAYERS, digest=digest, max_total_bytes=LIMIT, timeout_s=TIMEOUT_S, **kw)


async def test_a_stage_crosses_a_link_too_slow_for_a_flat_deadline(nursery, autojump_clock):
    me, holder, offer, _ = await one_holder(nursery, SLOW_BPS)
    with pytest.raises(RecoveryError, match="timed out"):
        await fetch(me, holder, offer.digest)  # four chunks in flight on a 1 Mbit/s link: 2.1 s > 1 s
    me, holder, offer, state = await one_holder(nursery, SLOW_BPS)  # a fresh link, nothing queued on it
    t0 = trio.current_time()
    result = await fetch(me, holder, offer.digest, rate_of=lambda peer: SLOW_BPS / 8)
    seconds = trio.current_time() - t0
    assert result.failed == {} and result.bytes == offer.manifest.total_bytes
    assert params_sha256(result.receiver.finish(SPEC, CFG, LAYERS)) == params_sha256(state)
    assert seconds >= result.bytes * 8 / SLOW_BPS  # it did cross the slow link


async def test_a_link_the_view_does_not_know_is_given_a_slow_links_time(nursery, autojump_clock):
    me, holder, offer, _ = await one_holder(nursery, SLOW_BPS)
    result = await fetch(me, holder, offer.digest, rate_of=lambda peer: None)
    assert result.failed == {} and result.bytes == offer.manifest.total_bytes


async def test_a_stalled_holder_on_a_fast_link_is_dropped_at_the_flat_deadline(nursery, autojump_clock):
    me, holder, offer, _ = await one_holder(nursery, 1e9, HangingServer)
    t0 = trio.current_time()
    with pytest.raises(RecoveryError, match="timed out"):
        await fetch(me, holder, offer.digest, rate_of=lambda peer: 1e9 / 8)
    assert trio.current_time() - t0 < TIMEOUT_S + 0.5  # the manifest's round trip and one chunk's deadline
