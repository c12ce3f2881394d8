"""net/dispatch.py: a connection's requests in flight and handlers running, and waiting until
neither is (what a retiring duplicate connection waits for before it closes)."""

from __future__ import annotations

import trio
import trio.testing

from dtfm.net.dispatch import Dispatcher, Requests

NOTE = 300


class _Conn:
    """The little of a connection that `Requests` and `Dispatcher` use."""

    short_id = "peer0000"
    closed = False

    def __init__(self) -> None:
        self.replies: list[int] = []

    async def _respond(self, msg_type, msg_id, body, payload) -> None:
        self.replies.append(msg_id)

    async def _respond_error(self, msg_id, reason) -> None:
        self.replies.append(msg_id)

    async def _abort(self, reason) -> None:
        self.closed = True


async def _nothing() -> None:
    pass


async def test_waiting_for_requests_ends_when_the_last_reply_comes_with_no_time_passing(mock_clock):
    requests, conn = Requests("peer0000"), _Conn()
    idle_at: list[float] = []

    async def wait() -> None:
        await requests.wait_idle()
        idle_at.append(trio.current_time())

    async with trio.open_nursery() as n:
        for msg_id in (1, 2):
            n.start_soon(requests.call, conn, msg_id, NOTE, _nothing, 60.0)
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        n.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        requests.reply(1, "one", None)
        await trio.testing.wait_all_tasks_blocked()
        assert requests.busy() and idle_at == []  # the second still waits
        requests.reply(2, "two", None)
        await trio.testing.wait_all_tasks_blocked()
        assert not requests.busy() and idle_at == [t0]


async def test_waiting_for_requests_ends_when_the_connection_closes():
    requests, conn = Requests("peer0000"), _Conn()
    done = trio.Event()

    async def call() -> None:
        try:
            await requests.call(conn, 1, NOTE, _nothing, 60.0)
        except Exception:
            pass

    async def wait() -> None:
        await requests.wait_idle()
        done.set()

    async with trio.open_nursery() as n:
        n.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        requests.close("gone")
        await trio.testing.wait_all_tasks_blocked()
        assert done.is_set()


async def test_waiting_for_handlers_ends_when_the_last_one_answered():
    conn = _Conn()
    release = [trio.Event(), trio.Event()]

    async def held(c, msg_type, body, payload):
        await release[body].wait()
        return {"ok": body}

    dispatcher = Dispatcher(conn, {NOTE: held}, max_concurrent=8)  # type: ignore[arg-type]
    idle = trio.Event()

    async def wait() -> None:
        await dispatcher.wait_idle()
        idle.set()

    async with trio.open_nursery() as n:
        dispatcher.deliver(n, NOTE, 11, 0, None, True)
        dispatcher.deliver(n, NOTE, 12, 1, None, True)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(wait)
        release[0].set()
        await trio.testing.wait_all_tasks_blocked()
        assert conn.replies == [11] and dispatcher.busy() and not idle.is_set()
        release[1].set()
        await trio.testing.wait_all_tasks_blocked()
        assert conn.replies == [11, 12] and not dispatcher.busy() and idle.is_set()
