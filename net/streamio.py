"""Buffered exact-length reads from a trio stream, for the record and handshake readers."""

from __future__ import annotations

import trio

from .errors import ConnectionClosed

_MIN_BUFFER = 64 * 1024


class StreamReader:
    """Reads exact byte counts with few copies; uses `recv_into` on real sockets.

    The view returned by `read_exactly` is valid until the next call.
    """

    def __init__(self, stream: trio.abc.ReceiveStream, initial_bytes: int = _MIN_BUFFER) -> None:
        self._stream = stream
        sock = getattr(stream, "socket", None)
        self._recv_into = getattr(sock, "recv_into", None)
        self._buf = bytearray(initial_bytes)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

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
                await self._fill()
        start = self._start
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return self._view[start : start + n]

    async def read_into(self, dest: memoryview) -> None:
        """Fill `dest` exactly: buffered bytes first, then straight from the socket."""
        n = len(dest)
        take = min(n, self._end - self._start)
        dest[:take] = self._view[self._start : self._start + take]
        self._start += take
        if self._start == self._end:
            self._start = self._end = 0
        pos = take
        while pos < n:
            if self._recv_into is not None:
                try:
                    got = await self._recv_into(dest[pos:], n - pos)
                except OSError as e:
                    raise ConnectionClosed(f"connection lost: {e}") from None
            else:
                try:
                    data = await self._stream.receive_some(n - pos)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    raise ConnectionClosed(f"connection lost: {e}") from None
                got = len(data)
                dest[pos : pos + got] = data
            if got == 0:
                raise ConnectionClosed("the peer closed the connection")
            pos += got

    async def _fill(self) -> None:
        room = len(self._buf) - self._end
        if self._recv_into is not None:
            try:
                got = await self._recv_into(self._view[self._end :], room)
            except OSError as e:
                raise ConnectionClosed(f"connection lost: {e}") from None
        else:
            try:
                data = await self._stream.receive_some(room)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise ConnectionClosed(f"connection lost: {e}") from None
            got = len(data)
            self._view[self._end : self._end + got] = data
        if got == 0:
            raise ConnectionClosed("the peer closed the connection")
        self._end += got
