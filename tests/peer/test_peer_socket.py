"""The daemon's Unix control socket (dtfm.peer.socket), in process: framing, limits, dispatch,
uid check, client errors."""

import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.net.errors import ProtocolError
from dtfm.net.wire import pack
from dtfm.peer import socket as peer_socket
from dtfm.peer.config import SocketConfig
from dtfm.peer.control_client import (
    DEPOSED,
    ControlClient,
    ControlClientError,
    ControlCommandError,
    ControlRequest,
    ControlSocketError,
    DaemonNotRunning,
    encode_frame,
    parse_response,
)
from dtfm.peer.socket import ControlServer, read_frame_untrusted

CONFIG = SocketConfig(max_request_bytes=4096, max_response_bytes=64 * 1024, request_timeout_s=5.0)


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def sock_dir():
    # Unix socket paths are short (108 bytes): keep them out of pytest's long tmp paths.
    with tempfile.TemporaryDirectory(prefix="dtfm-ctl-", dir="/tmp") as d:
        os.chmod(d, 0o700)
        yield Path(d)


def make_server(path, **kw):
    server = ControlServer(path, CONFIG, **kw)

    async def echo(args):
        return {"args": args}

    async def refuse(args):
        raise ControlCommandError("not now: the swarm is reconfiguring")

    async def crash(args):
        raise KeyError("boom")

    async def deposed(args):
        raise ControlCommandError("the coordinator was replaced", code=DEPOSED)

    server.register("echo", echo)
    server.register("refuse", refuse)
    server.register("crash", crash)
    server.register("deposed", deposed)
    return server


async def exchange(server, *frames: bytes) -> list[object]:
    """Feed raw bytes to handle_stream over a memory stream; return the decoded replies."""
    client, daemon_side = trio.testing.memory_stream_pair()
    replies = []
    async def serve():
        async with daemon_side:
            await server.handle_stream(daemon_side)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        for frame in frames:
            await client.send_all(frame)
        await client.send_eof()
        while True:
            reply = await read_frame_untrusted(client, CONFIG.max_response_bytes)
            if reply is None:
                break
            replies.append(reply)
    return replies


def request_frame(op, args=None):
    return encode_frame(ControlRequest(op, args or {}).to_wire(), CONFIG.max_request_bytes)


async def test_requests_on_one_connection_are_answered_in_order(sock_dir):
    server = make_server(sock_dir / "s")
    replies = await exchange(server, request_frame("echo", {"n": 1}), request_frame("echo", {"n": 2}))
    assert replies == [{"ok": True, "result": {"args": {"n": 1}}},
                       {"ok": True, "result": {"args": {"n": 2}}}]


async def test_refusals_and_failures_become_error_replies(sock_dir):
    server = make_server(sock_dir / "s")
    replies = await exchange(server, request_frame("refuse"), request_frame("nosuch"),
                             request_frame("crash"), request_frame("echo"))
    assert replies[0] == {"ok": False, "error": "not now: the swarm is reconfiguring"}
    assert replies[1]["ok"] is False
    assert "unknown command 'nosuch'" in replies[1]["error"]
    assert "crash, deposed, echo, refuse" in replies[1]["error"]
    assert replies[2]["ok"] is False and "KeyError" in replies[2]["error"]
    assert replies[3]["ok"] is True   # the connection survived all three


async def test_a_refusal_names_its_kind_where_the_handler_gave_one(sock_dir):
    server = make_server(sock_dir / "s")
    plain, coded = await exchange(server, request_frame("refuse"), request_frame("deposed"))
    assert "code" not in plain
    assert coded == {"ok": False, "error": "the coordinator was replaced", "code": DEPOSED}
    with pytest.raises(ControlClientError, match="replaced") as e:
        parse_response(coded)
    assert e.value.code == DEPOSED
    with pytest.raises(ControlClientError) as e:
        parse_response(plain)
    assert e.value.code is None
    with pytest.raises(ControlClientError) as e:  # (a code is a short name, or none)
        parse_response({**coded, "code": "x" * 100})
    assert e.value.code is None


@pytest.mark.parametrize("frame,reason", [
    (struct.pack(">I", 4097), "exceeds the 4096-byte limit"),
    (struct.pack(">I", 0xFFFFFFFF), "exceeds"),
    (struct.pack(">I", 3) + b"\xc1\xc1\xc1", ""),                  # not msgpack
    (struct.pack(">I", 1) + b"\x05", "not a map"),
    (encode_frame({"v": 99, "op": "echo"}, 4096), "version"),
    (encode_frame({"v": 1, "op": "x" * 33}, 4096), "too long"),
    (encode_frame({"v": 1, "op": "echo", "args": [1]}, 4096), "args"),
    (struct.pack(">I", 4000) + b"\x90" * 4000, ""),                # array bomb
])
async def test_bad_frames_get_one_error_reply_then_close(sock_dir, frame, reason):
    server = make_server(sock_dir / "s")
    replies = await exchange(server, frame, request_frame("echo"))
    assert len(replies) == 1
    assert replies[0]["ok"] is False
    assert replies[0]["error"].startswith("bad request")
    assert reason in replies[0]["error"]


async def test_frame_cut_short_gets_an_error_reply(sock_dir):
    replies = await exchange(make_server(sock_dir / "s"), struct.pack(">I", 10) + b"\x81")
    assert replies == [{"ok": False, "error": "bad request: control connection closed inside "
                                              "a frame"}]


async def test_read_frame_raises_only_protocol_error():
    for data in [b"\x00\x00\x00\x02\x92", b"\x00\x00\x10\x00", b"\x00\x00\x00\x01\xc1"]:
        a, b = trio.testing.memory_stream_pair()
        await a.send_all(data)
        await a.send_eof()
        with pytest.raises(ProtocolError):
            await read_frame_untrusted(b, 1024)


async def serve_and_call(server, fn):
    """Run the server, call blocking `fn` in a thread, stop the server; fn's errors re-raise."""
    def capture():
        try:
            return fn(), None
        except Exception as e:
            return None, e

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        result, error = await trio.to_thread.run_sync(capture)
        nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


async def test_real_socket_roundtrip_mode_and_cleanup(sock_dir):
    path = sock_dir / "s"
    server = make_server(path)

    def client_calls():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with ControlClient(path, CONFIG) as c:
            first = c.request("echo", {"x": b"\x00"})
            with pytest.raises(ControlClientError, match="reconfiguring"):
                c.request("refuse")
            return first, c.request("echo")

    first, second = await serve_and_call(server, client_calls)
    assert first == {"args": {"x": b"\x00"}}
    assert second == {"args": {}}
    assert not path.exists()   # removed when the server stops


async def test_stale_socket_file_is_replaced(sock_dir):
    path = sock_dir / "s"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()   # the file stays, nobody listens

    def call():
        with ControlClient(path, CONFIG) as c:
            return c.request("echo")

    assert await serve_and_call(make_server(path), call) == {"args": {}}


async def test_other_uid_is_refused(sock_dir):
    path = sock_dir / "s"
    server = make_server(path, allowed_uid=os.getuid() + 1)

    def call():
        with ControlClient(path, CONFIG) as c:
            return c.request("echo")

    with pytest.raises(ControlClientError, match="permission denied"):
        await serve_and_call(server, call)


def test_no_daemon_is_a_clear_error(sock_dir):
    data_dir = sock_dir / "data"
    with pytest.raises(DaemonNotRunning) as info:
        ControlClient(data_dir / "control" / "peer.sock", CONFIG).connect()
    assert str(info.value) == (f"no daemon is running for data dir {data_dir}: "
                               "start one with `dtfm-peer join`")
    # A socket file left by a daemon that died: the same error.
    (data_dir / "control").mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(data_dir / "control" / "peer.sock"))
    stale.close()
    with pytest.raises(DaemonNotRunning):
        ControlClient(data_dir / "control" / "peer.sock", CONFIG).connect()


async def test_oversize_reply_is_refused_by_the_client(sock_dir):
    path = sock_dir / "s"
    server = ControlServer(path, SocketConfig(max_response_bytes=1024 * 1024))

    async def big(args):
        return "x" * 200_000

    server.register("big", big)

    def call():
        with ControlClient(path, SocketConfig(max_response_bytes=64 * 1024)) as c:
            return c.request("big")

    with pytest.raises(ControlClientError, match="exceeds"):
        await serve_and_call(server, call)


async def test_silent_client_is_dropped_after_the_idle_timeout(sock_dir, autojump_clock):
    server = ControlServer(sock_dir / "s", SocketConfig(idle_timeout_s=30.0))
    client, daemon_side = trio.testing.memory_stream_pair()
    t0 = trio.current_time()
    await server.handle_stream(daemon_side)   # returns: nothing arrived for 30 s
    assert trio.current_time() - t0 == pytest.approx(30.0)


async def test_unencodable_or_oversize_results_become_error_replies(sock_dir):
    server = ControlServer(sock_dir / "s", CONFIG)

    async def odd(args):
        return object()

    async def huge(args):
        return "x" * (CONFIG.max_response_bytes + 1)

    server.register("odd", odd)
    server.register("huge", huge)
    replies = await exchange(server, request_frame("odd"), request_frame("huge"))
    assert [r["ok"] for r in replies] == [False, False]
    assert "cannot send the reply to odd" in replies[0]["error"]
    assert "cannot send the reply to huge" in replies[1]["error"]


def test_register_checks_names():
    server = ControlServer(Path("/nonexistent/s"), CONFIG)

    async def h(args):
        return None

    server.register("status", h)
    with pytest.raises(ValueError):
        server.register("status", h)
    with pytest.raises(ValueError):
        server.register("", h)


def test_pack_of_request_is_stable():
    assert ControlRequest.from_wire(ControlRequest("leave").to_wire()) == ControlRequest("leave")
    assert pack(ControlRequest("x").to_wire())


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash_the_server(data):
    async def main():
        server = ControlServer(Path("/nonexistent/s"), CONFIG)

        async def echo(args):
            return args

        server.register("echo", echo)
        return await exchange(server, data)

    replies = trio.run(main)
    # Whatever arrives, each reply is a well-formed {ok: ...} map; garbage gets at most one.
    assert all(isinstance(r, dict) and isinstance(r.get("ok"), bool) for r in replies)
    assert sum(1 for r in replies if not r["ok"]) <= 1


# ---- bounds: credentials, clients, time ----------------------------------------------------------

def test_no_peer_credentials_means_no_control_socket(sock_dir, monkeypatch):
    monkeypatch.delattr(socket, "SO_PEERCRED")
    server = make_server(sock_dir / "s")

    async def main():
        with pytest.raises(ControlSocketError, match="SO_PEERCRED"):
            await server.serve()

    trio.run(main)
    assert not (sock_dir / "s").exists()


async def test_caller_whose_uid_cannot_be_read_is_refused(sock_dir, monkeypatch):
    monkeypatch.setattr(peer_socket, "peer_uid", lambda sock: None)
    path = sock_dir / "s"

    def call():
        with ControlClient(path, CONFIG) as c:
            return c.request("echo")

    with pytest.raises(ControlClientError, match="permission denied"):
        await serve_and_call(make_server(path), call)


class _Stream(trio.abc.Stream):
    """One end of an in-memory connection, with the `socket` attribute the server reads."""

    def __init__(self, inner):
        self.inner, self.socket = inner, None

    async def send_all(self, data):
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self):
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def aclose(self):
        await self.inner.aclose()


class _Listener:
    def __init__(self):
        self.send, self.recv = trio.open_memory_channel(100)

    async def accept(self):
        return await self.recv.receive()

    def connect(self):
        client, daemon_side = trio.testing.memory_stream_pair()
        self.send.send_nowait(_Stream(daemon_side))
        return client


async def test_clients_beyond_max_clients_are_refused_until_a_slot_frees(autojump_clock, monkeypatch):
    monkeypatch.setattr(peer_socket, "peer_uid", lambda sock: os.getuid())
    server = make_server(Path("/nonexistent"))
    server.config = SocketConfig(max_clients=2, idle_timeout_s=60.0)
    listener = _Listener()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server._accept_loop, listener, nursery)
        silent = [listener.connect() for _ in range(2)]   # connect and send nothing
        await trio.sleep(1.0)
        assert server.clients == 2
        third = listener.connect()
        reply = await read_frame_untrusted(third, CONFIG.max_response_bytes)
        assert reply["ok"] is False and "busy" in reply["error"]
        assert await read_frame_untrusted(third, CONFIG.max_response_bytes) is None   # closed
        assert server.clients == 2
        await trio.sleep(60.0)               # the silent ones are dropped after idle_timeout_s
        assert server.clients == 0
        for s in silent:
            assert await read_frame_untrusted(s, CONFIG.max_response_bytes) is None
        fourth = listener.connect()
        await fourth.send_all(request_frame("echo", {"n": 4}))
        reply = await read_frame_untrusted(fourth, CONFIG.max_response_bytes)
        assert reply == {"ok": True, "result": {"args": {"n": 4}}}
        nursery.cancel_scope.cancel()


async def test_client_that_stops_inside_a_frame_is_dropped_after_the_idle_timeout(autojump_clock):
    server = ControlServer(Path("/nonexistent"), SocketConfig(idle_timeout_s=30.0))
    client, daemon_side = trio.testing.memory_stream_pair()
    await client.send_all(request_frame("echo")[:6])    # the length and two bytes, then silence
    t0 = trio.current_time()
    await server.handle_stream(daemon_side)
    assert trio.current_time() - t0 == pytest.approx(30.0)


async def test_an_op_that_runs_too_long_is_cancelled_with_an_error_reply(autojump_clock):
    server = ControlServer(Path("/nonexistent"), SocketConfig(handler_timeout_s=5.0))

    async def hang(args):
        await trio.sleep_forever()

    server.register("hang", hang)
    t0 = trio.current_time()
    replies = await exchange(server, request_frame("hang"))
    assert replies == [{"ok": False, "error": "hang did not finish within 5 s"}]
    assert trio.current_time() - t0 == pytest.approx(5.0)
