"""Exact-length reads and whole writes on a trio stream, for the record and handshake layers.

On a socket (a `trio.SocketStream` on POSIX) both go to the file descriptor directly: a read
or write that can make progress costs one system call and no trip through trio's scheduler, and
a task waits for the socket only when it would block. Other streams (in-memory test streams)
go through `receive_some` / `send_all`.
"""

from __future__ import annotations

import math
import os

import trio

from .errors import ConnectionClosed

_MIN_BUFFER = 64 * 1024
_RAW_IO = os.name == "posix" and hasattr(os, "readv")
# A read that waits is woken at the first byte: the socket's low-water mark is the kernel's
# default. Raising it for a large read (SO_RCVLOWAT, up to 1 MiB) saved a fifth of the
# receiver's CPU on 64 MiB payloads, but the kernel did not always wake such a reader once
# the bytes were in: one direction of a connection then delivered nothing until the 60 s idle
# timeout, though its sender wrote (docs/transport.md, "The payload path").


def _raw_socket(stream: object) -> trio.socket.SocketType | None:
    sock = getattr(stream, "socket", None)
    return sock if _RAW_IO and isinstance(sock, trio.socket.SocketType) else None


class StreamReader:
    """Reads exact byte counts with few copies; reads the socket's descriptor directly.

    The view returned by `read_exactly` is valid until the next call. `waits` counts the times
    a read had to wait for the stream (each one a checkpoint). A read still waiting at
    `deadline` (trio time) raises `trio.TooSlowError`; the deadline costs nothing while data
    is there.
    """

    def __init__(self, stream: trio.abc.ReceiveStream, initial_bytes: int = _MIN_BUFFER) -> None:
        self._stream = stream
        self._sock = _raw_socket(stream)
        self._buf = bytearray(initial_bytes)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self.waits = 0
        self.deadline = math.inf

    def _make_room(self, n: int) -> None:
        have = self._end - self._start
        if len(self._buf) - self._start >= n:
            return
        if len(self._buf) >= n:
            self._view[:have] = self._view[self._start : self._end]
        else:
            size = max(n, 2 * len(self._buf))
            new = bytearray(size)
            new[:have] = self._view[self._start : self._end]
            self._view.release()
            self._buf = new
            self._view = memoryview(new)
        self._start, self._end = 0, have

    async def read_exactly(self, n: int) -> memoryview:
        if self._end - self._start < n:
            self._make_room(n)
            while self._end - self._start < n:
                self._end += await self._recv_into(self._view[self._end :])
        start = self._start
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return self._view[start : start + n]

    async def read_into(self, dest: memoryview) -> None:
        """Fill `dest` exactly: buffered bytes first, then straight from the socket."""
        n = dest.nbytes
        take = min(n, self._end - self._start)
        if take:
            dest[:take] = self._view[self._start : self._start + take]
            self._start += take
            if self._start == self._end:
                self._start = self._end = 0
        pos = take
        while pos < n:
            pos += await self._recv_into(dest[pos:])

    async def _recv_into(self, view: memoryview) -> int:
        """At least one byte into `view`; waits only when nothing has arrived."""
        sock = self._sock
        if sock is None:
            self.waits += 1
            try:
                with trio.fail_at(self.deadline):
                    data = await self._stream.receive_some(view.nbytes)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise ConnectionClosed(f"connection lost: {e}") from None
            got = len(data)
            view[:got] = data
        else:
            while True:
                try:
                    got = os.readv(sock.fileno(), (view,))
                    break
                except BlockingIOError:
                    pass
                except OSError as e:
                    raise ConnectionClosed(f"connection lost: {e}") from None
                self.waits += 1
                try:
                    with trio.fail_at(self.deadline):
                        await trio.lowlevel.wait_readable(sock)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    raise ConnectionClosed(f"connection lost: {e}") from None
        if got == 0:
            raise ConnectionClosed("the peer closed the connection")
        return got


class StreamWriter:
    """Writes whole buffers; on a socket, straight to its descriptor. `waits` and `deadline`
    as in `StreamReader`.

    Raises `OSError`, `trio.BrokenResourceError` or `trio.ClosedResourceError` when the
    connection is gone.
    """

    def __init__(self, stream: trio.abc.SendStream) -> None:
        self._stream = stream
        self._sock = _raw_socket(stream)
        self.waits = 0
        self.deadline = math.inf

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        sock = self._sock
        if sock is None:
            self.waits += 1
            with trio.fail_at(self.deadline):
                await self._stream.send_all(data)
            return
        view = memoryview(data)
        n = view.nbytes
        pos = 0
        while True:
            try:
                pos += os.write(sock.fileno(), view[pos:])
            except BlockingIOError:
                self.waits += 1
                with trio.fail_at(self.deadline):
                    await trio.lowlevel.wait_writable(sock)
                continue
            if pos >= n:
                return
