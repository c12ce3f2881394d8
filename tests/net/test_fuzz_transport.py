"""Bad input thrown at a listening transport: it must close that connection, stay cheap in
memory and time, and keep serving a healthy peer."""

import gc
import logging
import struct
import time
import tracemalloc

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtfm.net import frames
from dtfm.net.errors import HandshakeError
from dtfm.net.handshake import MSG1_LEN, PROTOCOL_VERSION, REFUSAL, Initiator, PeerHello, reject_message
from dtfm.net.identity import Identity, swarm_key_fingerprint
from dtfm.net.session import RecvCipher, SendCipher
from dtfm.net.streamio import StreamReader
from dtfm.net.transport import Transport, TransportConfig
from dtfm.net.wire import pack

KEY = bytes(range(32))
MiB = 1 << 20
ECHO = 40
# The transport-wide payload budget holds two of the 16 MiB payloads the bomb below declares.
CONFIG = TransportConfig(**{**TransportConfig.test().__dict__, "max_control_frame_bytes": 1 * MiB,
                            "max_payload_bytes": 32 * MiB, "max_total_payload_bytes": 40 * MiB})
BOMB_PAYLOAD_BYTES = 16 * MiB


class StepTimer(trio.abc.Instrument):
    """Longest CPU time any single task step took: how long the event loop was blocked."""

    def __init__(self):
        self.longest_s = 0.0
        self._t0 = None  # the step that adds the instrument ends without having started

    def before_task_step(self, task):
        self._t0 = time.thread_time()

    def after_task_step(self, task):
        if self._t0 is not None:
            self.longest_s = max(self.longest_s, time.thread_time() - self._t0)


class RawPeer:
    """A swarm member that completes a real handshake, then sends whatever records it likes."""

    def __init__(self, stream, hs):
        self.stream = stream
        self.send = SendCipher(hs.send_key, hs.suite)
        self.recv = RecvCipher(hs.recv_key, hs.suite)
        self.records = []

    @classmethod
    async def connect(cls, port, key=KEY):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        try:
            reader = StreamReader(stream)
            init = Initiator(Identity.generate(), key, PeerHello("", ("127.0.0.1", 1)))
            msg1 = init.first_message()
            await stream.send_all(struct.pack(">I", len(msg1)) + msg1)
            n = int.from_bytes(await reader.read_exactly(4), "big")
            msg3, hs = init.on_response(bytes(await reader.read_exactly(n)))
            await stream.send_all(struct.pack(">I", len(msg3)) + msg3)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return cls(stream, hs)

    def seal(self, frame):
        record = bytes(self.send.seal(frame))
        self.records.append(record)
        return record

    async def send_frame(self, frame):
        await self.send_raw(self.seal(frame))

    async def send_raw(self, data):
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def wait_closed(self):
        """Until the server closes the connection (bounded)."""
        try:
            with trio.fail_after(10):
                while await self.stream.receive_some(1 << 16):
                    pass
        except trio.BrokenResourceError:
            pass
        finally:
            await self.stream.aclose()


async def test_raw_peer_speaks_the_protocol():
    """Control for the attacks below: the same raw peer's well-formed request is answered."""
    server = make_server()
    async with trio.open_nursery() as n:
        _, port = await n.start(server.serve, "127.0.0.1", 0)
        raw = await RawPeer.connect(port)
        await raw.send_frame(msg(pack({"hi": 1}), msg_id=7))
        reader = StreamReader(raw.stream)
        n_body = int.from_bytes(await reader.read_exactly(4), "big")
        record = bytes(await reader.read_exactly(n_body))
        frame = raw.recv.open(struct.pack(">I", n_body) + record)
        event = frames.Inbound(
            max_control_frame_bytes=MiB, max_payload_bytes=0, max_inflight_payload_bytes=0, max_inflight_payloads=1
        ).on_frame(frame)
        assert event.flags & frames.FLAG_RESPONSE and event.reply_to == 7 and event.body == {"hi": 1}
        await raw.stream.aclose()
        n.cancel_scope.cancel()


def msg(body_bytes, msg_type=ECHO, flags=frames.FLAG_REQUEST, payload_len=0, msg_id=1):
    return struct.pack(">BBBQQQ", frames.MSG, msg_type, flags, msg_id, 0, payload_len) + body_bytes


def chunk_records(msg_id, data):
    """The plaintext records that carry `data` as the next piece of msg_id's payload."""
    return [frames.encode_chunk(msg_id, len(data)), data]


def attacks():
    """name -> async function(raw peer) doing something a healthy peer never does."""
    deep = b"\x91" * 1025 + b"\xc0"
    n_empty = MiB - frames.MSG_HEADER_BYTES - 5

    async def frame_of(raw, body):
        await raw.send_frame(msg(body))

    async def replay(raw):
        await raw.send_frame(msg(pack(1)))
        await raw.send_raw(raw.records[-1])

    async def reorder(raw):
        r1, r2 = raw.seal(msg(pack(1), msg_id=1)), raw.seal(msg(pack(2), msg_id=2))
        await raw.send_raw(r2 + r1)

    async def tamper(raw):
        record = bytearray(raw.seal(msg(pack({"a": 1}))))
        record[10] ^= 0x01
        await raw.send_raw(bytes(record))

    async def truncated(raw):
        await raw.send_raw(raw.seal(msg(pack(1)))[:-5])
        await raw.stream.send_eof()

    async def inflight(raw):
        # Big payloads, each started with a chunk, so each one the receiver takes commits memory:
        # the budget takes two, refuses the next ones, and the 17th is one too many to track.
        for i in range(CONFIG.max_inflight_payloads + 1):
            await raw.send_frame(msg(pack(None), payload_len=BOMB_PAYLOAD_BYTES, msg_id=i + 1))
            for record in chunk_records(i + 1, bytes(CONFIG.chunk_bytes)):
                await raw.send_frame(record)

    return {
        "oversize prefix 2^32-1": lambda raw: raw.send_raw(b"\xff\xff\xff\xff" + b"\x00" * 1000),
        "prefix announcing 50 MB": lambda raw: raw.send_raw(struct.pack(">I", 50_000_000) + b"\x90" * 65536),
        "record shorter than a tag": lambda raw: raw.send_raw(struct.pack(">I", 3) + b"abc"),
        "truncated record": truncated,
        "random record": lambda raw: raw.send_raw(struct.pack(">I", 64) + bytes(range(64))),
        "replayed record": replay,
        "reordered records": reorder,
        "tampered record": tamper,
        "unknown frame kind": lambda raw: raw.send_frame(b"\x09hello"),
        "empty frame": lambda raw: raw.send_frame(b""),
        "bad flags": lambda raw: raw.send_frame(msg(pack(1), flags=0x80)),
        "truncated message header": lambda raw: raw.send_frame(msg(pack(1))[:10]),
        "1 MiB of 0x90": lambda raw: frame_of(raw, b"\x90" * (MiB - frames.MSG_HEADER_BYTES)),
        "array header 2^32-1": lambda raw: frame_of(raw, b"\xdd\xff\xff\xff\xff"),
        "1 MiB array of empty arrays": lambda raw: frame_of(raw, b"\xdd" + n_empty.to_bytes(4, "big") + b"\x90" * n_empty),
        "nesting 1025 deep": lambda raw: frame_of(raw, deep),
        "mixed key types": lambda raw: frame_of(raw, msgpack.packb({"a": 1, b"b": 2, 3: 4}, use_bin_type=True)),
        "NaN": lambda raw: frame_of(raw, msgpack.packb({"x": float("nan")})),
        "infinity": lambda raw: frame_of(raw, msgpack.packb([1.0, float("inf")])),
        "malformed msgpack": lambda raw: frame_of(raw, b"\xc1\xc1"),
        "chunk for unknown message": lambda raw: raw.send_frame(struct.pack(">BQ", frames.CHUNK, 99) + b"x"),
        "payload over the limit": lambda raw: raw.send_frame(msg(pack(None), payload_len=CONFIG.max_payload_bytes + 1)),
        "too many payloads in flight": inflight,
        "close frame": lambda raw: raw.send_frame(frames.encode_close("bye")),
    }


async def healthy_round_trip(nursery, port):
    peer = Transport(Identity.generate(), KEY, CONFIG)
    await nursery.start(peer.run)
    conn = await peer.connect("127.0.0.1", port)
    assert (await conn.request(ECHO, {"ok": 1}))[0] == {"ok": 1}
    await conn.ping()
    await conn.close()


def make_server():
    server = Transport(Identity.generate(), KEY, CONFIG)

    async def echo(conn, msg_type, body, payload):
        return body

    server.handle(ECHO, echo)
    return server


@pytest.mark.parametrize("name", list(attacks()))
async def test_bad_input_after_handshake_closes_only_that_connection(name, caplog):
    caplog.set_level(logging.DEBUG, logger="dtfm.net")
    server = make_server()
    timer = StepTimer()
    # Objects left by earlier tests must not make a full collection land inside a measured step:
    # the bound is on the transport's own work.
    gc.collect()
    gc.freeze()
    trio.lowlevel.add_instrument(timer)
    try:
        async with trio.open_nursery() as n:
            _, port = await n.start(server.serve, "127.0.0.1", 0)
            bystander = Transport(Identity.generate(), KEY, CONFIG)
            await n.start(bystander.run)
            standing = await bystander.connect("127.0.0.1", port)
            raw = await RawPeer.connect(port)
            await attacks()[name](raw)
            await raw.wait_closed()
            assert server._payload_budget.used_bytes == 0  # whatever it held came back on closing
            assert (await standing.request(ECHO, "still served"))[0] == "still served"
            await healthy_round_trip(n, port)
            n.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(timer)
        gc.unfreeze()
    assert timer.longest_s < 0.05, f"event loop blocked for {timer.longest_s * 1000:.1f} ms"
    if name in EXPECTED_REASON:
        reason = EXPECTED_REASON[name]
        assert any("bad input" in r.getMessage() and reason in r.getMessage() for r in caplog.records), reason
    if name == "too many payloads in flight":
        refused = [r for r in caplog.records if r.levelno == logging.WARNING and "payload budget" in r.getMessage()]
        assert len(refused) == CONFIG.max_inflight_payloads - 2


EXPECTED_REASON = {
    "oversize prefix 2^32-1": "exceeds the limit",
    "prefix announcing 50 MB": "exceeds the limit",
    "record shorter than a tag": "shorter than its tag",
    "random record": "failed authentication",
    "replayed record": "failed authentication",
    "reordered records": "failed authentication",
    "tampered record": "failed authentication",
    "unknown frame kind": "unknown frame kind",
    "empty frame": "empty frame",
    "bad flags": "bad message flags",
    "truncated message header": "truncated message header",
    "1 MiB of 0x90": "trailing bytes",
    "1 MiB array of empty arrays": "arrays/maps in one message",
    "array header 2^32-1": "exceeds max_array_len",
    "nesting 1025 deep": "nested",
    "mixed key types": "map key",
    "NaN": "non-finite",
    "infinity": "non-finite",
    "malformed msgpack": "malformed msgpack",
    "chunk for unknown message": "unknown message id",
    "payload over the limit": "exceeds",
    "too many payloads in flight": "in flight",
}


async def test_bombs_stay_under_50_mib():
    bombs = [
        "1 MiB of 0x90",
        "1 MiB array of empty arrays",
        "array header 2^32-1",
        "prefix announcing 50 MB",
        "nesting 1025 deep",
        "mixed key types",
        "NaN",
        "too many payloads in flight",
    ]
    server = make_server()
    peaks = {}
    async with trio.open_nursery() as n:
        _, port = await n.start(server.serve, "127.0.0.1", 0)
        tracemalloc.start()
        try:
            for name in bombs:
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
                raw = await RawPeer.connect(port)
                await attacks()[name](raw)
                await raw.wait_closed()
                peaks[name] = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        await healthy_round_trip(n, port)
        n.cancel_scope.cancel()
    assert max(peaks.values()) < 50 * MiB, {k: f"{v / MiB:.1f} MiB" for k, v in peaks.items()}
    # The payload bomb really committed memory: the two payloads the budget let in, no more.
    assert peaks["too many payloads in flight"] >= 2 * BOMB_PAYLOAD_BYTES
    assert server._payload_budget.used_bytes == 0


async def test_wrong_key_is_refused_without_the_keys_fingerprint():
    server = make_server()
    async with trio.open_nursery() as n:
        _, port = await n.start(server.serve, "127.0.0.1", 0)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        msg1 = Initiator(Identity.generate(), bytes(32), PeerHello("", ("", 0))).first_message()
        await stream.send_all(struct.pack(">I", len(msg1)) + msg1)
        answer = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(4096):
                answer += chunk
        await stream.aclose()
        refusal = reject_message(REFUSAL)
        assert answer == struct.pack(">I", len(refusal)) + refusal  # that, and nothing else
        assert swarm_key_fingerprint(KEY).encode() not in answer
        with pytest.raises(HandshakeError, match="refused by peer: handshake refused") as e:
            await RawPeer.connect(port, key=bytes(32))
        assert swarm_key_fingerprint(KEY) not in str(e.value)
        await healthy_round_trip(n, port)
        n.cancel_scope.cancel()


async def test_replayed_handshake_is_refused_as_a_replay(caplog):
    caplog.set_level(logging.DEBUG, logger="dtfm.net.transport")
    server = make_server()
    connected = []
    server.on_connect(connected.append)
    async with trio.open_nursery() as n:
        _, port = await n.start(server.serve, "127.0.0.1", 0)
        # a member's handshake, recorded off the wire
        member = Identity.generate()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        reader = StreamReader(stream)
        init = Initiator(member, KEY, PeerHello("", ("", 0)))
        msg1 = init.first_message()
        await stream.send_all(struct.pack(">I", len(msg1)) + msg1)
        n2 = int.from_bytes(await reader.read_exactly(4), "big")
        msg3, _ = init.on_response(bytes(await reader.read_exactly(n2)))
        await stream.send_all(struct.pack(">I", len(msg3)) + msg3)
        with trio.fail_after(10):
            while not connected:
                await trio.sleep(0.01)
        await stream.aclose()
        # played again by someone without the key: refused at the hello, before any key exchange
        # (so the recorded third message never gets read)
        replay = await trio.open_tcp_stream("127.0.0.1", port)
        await replay.send_all(struct.pack(">I", len(msg1)) + msg1)
        answer = b""
        with trio.fail_after(10):
            while chunk := await replay.receive_some(4096):
                answer += chunk
        await replay.aclose()
        refusal = reject_message(REFUSAL)
        assert answer == struct.pack(">I", len(refusal)) + refusal
        assert any("refused handshake from 127.0.0.1:" in r.getMessage() and "replayed hello" in r.getMessage()
                   for r in caplog.records)
        assert [c.peer_id for c in connected] == [member.peer_id]  # only the original got through
        await healthy_round_trip(n, port)
        n.cancel_scope.cancel()


async def _garbage_scenario(blobs):
    server = make_server()
    async with trio.open_nursery() as n:
        _, port = await n.start(server.serve, "127.0.0.1", 0)
        for blob in blobs:
            s = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                await s.send_all(blob)
            except trio.BrokenResourceError:
                pass
            await s.aclose()
        await healthy_round_trip(n, port)
        n.cancel_scope.cancel()


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(
        st.binary(max_size=300)
        | st.builds(lambda b: struct.pack(">I", MSG1_LEN) + b, st.binary(min_size=MSG1_LEN, max_size=MSG1_LEN))
        | st.builds(lambda b: struct.pack(">I", MSG1_LEN) + b"DTFM" + bytes([PROTOCOL_VERSION]) + b,
                    st.binary(max_size=60)),
        min_size=1,
        max_size=6,
    )
)
def test_random_bytes_before_handshake(blobs):
    trio.run(_garbage_scenario, blobs)


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=100))
def test_inbound_frame_parser_raises_only_protocol_error(data):
    from dtfm.net.errors import ProtocolError

    inbound = frames.Inbound(
        max_control_frame_bytes=MiB, max_payload_bytes=MiB, max_inflight_payload_bytes=2 * MiB, max_inflight_payloads=4
    )
    try:
        inbound.on_frame(data)
    except ProtocolError:
        pass
