"""The local control socket, the daemon's side: `dtfm-peer status` and `leave` talk to the
running daemon here. The protocol and the CLI's blocking client are peer/control_client.py;
several requests may follow on one connection.

Only the daemon's own user may connect: the socket is 0600 in a 0700 directory, and the
daemon checks each caller's uid with SO_PEERCRED (Linux) and closes on a mismatch. On a system
without SO_PEERCRED the server refuses to start rather than serve callers it cannot identify.

Bounded: at most `max_clients` connections are served at once (one more is answered "busy"
and closed), a connection silent for `idle_timeout_s` is dropped, and an op that runs longer
than `handler_timeout_s` is cancelled and answered with an error.
"""

from __future__ import annotations

import logging
import os
import socket as stdsocket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from dtfm.net import ProtocolError, unpack_untrusted

from .config import SocketConfig
from .control_client import (FRAME_HEADER, MAX_OP_LEN, ControlCommandError, ControlRequest, ControlSocketError,
                             encode_frame)

logger = logging.getLogger(__name__)

ControlHandler = Callable[[dict[str, Any]], Awaitable[Any]]


# ---- server -----------------------------------------------------------------------------------

async def _read_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes | None:
    """n bytes, or None on a clean EOF before the first byte; ProtocolError on a cut frame."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            if not buf:
                return None
            raise ProtocolError("control connection closed inside a frame")
        buf += chunk
    return bytes(buf)


async def read_frame_untrusted(stream: trio.abc.ReceiveStream, max_len: int) -> object | None:
    """One decoded frame, None at EOF; ProtocolError for anything malformed or oversize."""
    head = await _read_exactly(stream, FRAME_HEADER.size)
    if head is None:
        return None
    (n,) = FRAME_HEADER.unpack(head)
    if n > max_len:
        raise ProtocolError(f"control frame of {n} bytes exceeds the {max_len}-byte limit")
    body = await _read_exactly(stream, n)
    if body is None:
        raise ProtocolError("control connection closed inside a frame")
    return unpack_untrusted(body, max_len=max_len)


def peer_credentials_supported() -> bool:
    """Whether this system tells a Unix socket server who connected (SO_PEERCRED)."""
    return getattr(stdsocket, "SO_PEERCRED", None) is not None


def peer_uid(sock: trio.socket.SocketType) -> int | None:
    """The uid of the process at the other end of a Unix socket; None where unsupported."""
    so_peercred = getattr(stdsocket, "SO_PEERCRED", None)
    if so_peercred is None:
        return None
    creds = sock.getsockopt(stdsocket.SOL_SOCKET, so_peercred, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class ControlServer:
    """Answers control requests on a Unix socket; ops are registered by the daemon."""

    def __init__(self, path: Path, config: SocketConfig, *, allowed_uid: int | None = None):
        self.path = Path(path)
        self.config = config
        self.allowed_uid = os.getuid() if allowed_uid is None else allowed_uid
        self._handlers: dict[str, ControlHandler] = {}
        self.clients = 0   # connections being served now, at most config.max_clients

    def register(self, op: str, handler: ControlHandler) -> None:
        if op in self._handlers:
            raise ValueError(f"control op {op!r} is already registered")
        if not 0 < len(op) <= MAX_OP_LEN:
            raise ValueError(f"control op name {op!r} must be 1..{MAX_OP_LEN} characters")
        self._handlers[op] = handler

    @property
    def ops(self) -> list[str]:
        return sorted(self._handlers)

    async def serve(self, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; the socket file is removed on the way out."""
        if not peer_credentials_supported():
            raise ControlSocketError(
                "this system has no SO_PEERCRED, so the control socket cannot check which user "
                "connects; refusing to serve it (run the daemon on Linux)")
        sock = await self._bind()
        try:
            listener = trio.SocketListener(sock)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._accept_loop, listener, nursery)
                task_status.started(self.path)
        finally:
            with trio.CancelScope(shield=True):
                sock.close()
                _unlink_quietly(self.path)

    async def _bind(self) -> trio.socket.SocketType:
        # The caller holds the data dir lock, so a socket file left here is stale.
        _unlink_quietly(self.path)
        sock = trio.socket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        try:
            await sock.bind(os.fspath(self.path))
            # Until this chmod the socket has the umask's mode; the 0700 directory keeps
            # other users out meanwhile.
            os.chmod(self.path, 0o600)
        except BaseException:
            sock.close()
            raise
        sock.listen(self.config.max_clients)
        return sock

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            stream = await listener.accept()
            if self.clients >= self.config.max_clients:
                logger.warning("control connection refused: %d clients already connected",
                               self.clients)
                async with stream:   # a fresh socket's buffer takes the short reply at once
                    await self._reply_quietly(stream, {"ok": False, "error": (
                        f"the daemon is busy: {self.clients} control connections are open; "
                        f"try again")}, timeout_s=1.0)
                continue
            self.clients += 1
            nursery.start_soon(self._serve_client, stream)

    async def _serve_client(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                try:
                    uid = peer_uid(stream.socket)
                except OSError as e:
                    logger.debug("control connection without credentials: %s", e)
                    return
                if uid is None or uid != self.allowed_uid:
                    logger.warning("control connection from uid %s refused: only uid %d may "
                                   "control this daemon", uid, self.allowed_uid)
                    await self._reply_quietly(stream, {"ok": False, "error":
                                                       "permission denied: another user's daemon"})
                    return
                await self.handle_stream(stream)
        finally:
            self.clients -= 1

    async def _reply_quietly(self, stream: trio.abc.SendStream, reply: dict, *,
                             timeout_s: float | None = None) -> None:
        with trio.move_on_after(self.config.request_timeout_s if timeout_s is None else timeout_s):
            try:
                await stream.send_all(encode_frame(reply, self.config.max_response_bytes))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def handle_stream(self, stream: trio.abc.Stream) -> None:
        """Serve requests on one connection until EOF or a malformed frame."""
        while True:
            try:
                with trio.fail_after(self.config.idle_timeout_s):
                    raw = await read_frame_untrusted(stream, self.config.max_request_bytes)
                if raw is None:
                    return
                request = ControlRequest.from_wire(raw)
            except ProtocolError as e:
                logger.debug("control request rejected: %s", e)
                await self._reply_quietly(stream, {"ok": False, "error": f"bad request: {e}"})
                return
            except trio.TooSlowError:
                logger.debug("control connection idle too long; closing")
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            reply = await self._dispatch(request)
            try:
                frame = encode_frame(reply, self.config.max_response_bytes)
            except Exception as e:   # too big, or a result msgpack cannot encode
                logger.warning("control reply to %s not sent: %s: %s", request.op,
                               type(e).__name__, e)
                frame = encode_frame({"ok": False, "error": f"cannot send the reply to "
                                      f"{request.op}: {e}"}, self.config.max_response_bytes)
            try:
                with trio.fail_after(self.config.request_timeout_s):
                    await stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
                return

    async def _dispatch(self, request: ControlRequest) -> dict[str, Any]:
        handler = self._handlers.get(request.op)
        if handler is None:
            return {"ok": False, "error": f"unknown command {request.op!r}; this daemon knows: "
                                          f"{', '.join(self.ops)}"}
        try:
            with trio.move_on_after(self.config.handler_timeout_s) as scope:
                result = await handler(request.args)
            if scope.cancelled_caught:
                logger.warning("control command %s cancelled after %g s", request.op,
                               self.config.handler_timeout_s)
                return {"ok": False, "error": f"{request.op} did not finish within "
                                              f"{self.config.handler_timeout_s:g} s"}
        except ControlCommandError as e:
            return {"ok": False, "error": str(e), **({} if e.code is None else {"code": e.code})}
        except Exception as e:
            logger.error("control command %s failed", request.op, exc_info=True)
            return {"ok": False, "error": f"internal error in {request.op}: {type(e).__name__}: {e}"}
        return {"ok": True, "result": result}


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
