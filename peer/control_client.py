"""The control socket's protocol and its blocking client: what the CLI needs to talk to a
running daemon, without an event loop (no trio: a `dtfm-peer status` starts in a fraction of a
second). The daemon's side is peer/socket.py.

Each frame is a 4-byte big-endian length, then that many bytes of msgpack. The client sends a
request map `{"v": 1, "op": NAME, "args": {...}}`; the daemon answers `{"ok": true, "result":
...}` or `{"ok": false, "error": TEXT}` (with `code` where the refusal has a kind). Both sides
refuse a frame longer than their limit before reading it.
"""

from __future__ import annotations

import errno
import os
import socket as stdsocket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtfm.net import ProtocolError, pack, unpack_untrusted

from .config import SocketConfig

__all__ = ["DEPOSED", "MAX_OP_LEN", "PROTOCOL_VERSION", "ControlClient", "ControlClientError", "ControlCommandError",
           "ControlRequest", "ControlSocketError", "DaemonNotRunning", "FRAME_HEADER", "encode_frame", "parse_response"]

PROTOCOL_VERSION = 1
MAX_OP_LEN = 32
# A refusal's code: an election replaced the coordinator that had the signed operation before
# it was done, so nothing was done; signed again, the operation can succeed.
DEPOSED = "deposed"
FRAME_HEADER = struct.Struct(">I")  # a frame's length


class ControlCommandError(Exception):
    """Raised by a handler to refuse a request; str() goes back to the client, and `code`
    (when given) beside it, for a client that acts on the kind of refusal."""

    def __init__(self, reason: str, *, code: str | None = None) -> None:
        super().__init__(reason)
        self.code = code


class DaemonNotRunning(Exception):
    """Nothing listens on the control socket; str() says which data dir and what to do."""


class ControlSocketError(Exception):
    """The daemon cannot serve its control socket safely here; str() says why and what to do."""


class ControlClientError(Exception):
    """The daemon answered badly or refused; str() is for the user, `code` the kind of a
    refusal where the daemon named one (DEPOSED: sign the operation again)."""

    def __init__(self, reason: str, *, code: str | None = None) -> None:
        super().__init__(reason)
        self.code = code


# ---- messages ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ControlRequest:
    op: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "op": self.op, "args": self.args}

    @classmethod
    def from_wire(cls, obj: object) -> "ControlRequest":
        if not isinstance(obj, dict):
            raise ProtocolError("control request is not a map")
        version = obj.get("v")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"control protocol version {version!r}, expected {PROTOCOL_VERSION}")
        op = obj.get("op")
        if not isinstance(op, str):
            raise ProtocolError("control request has no op")
        if not 0 < len(op) <= MAX_OP_LEN:
            raise ProtocolError("control op name too long or empty")
        args = obj.get("args", {})
        if not isinstance(args, dict):
            raise ProtocolError("control args is not a map")
        return cls(op, args)


def encode_frame(obj: object, max_len: int) -> bytes:
    body = pack(obj)
    if len(body) > max_len:
        raise ValueError(f"control frame of {len(body)} bytes exceeds {max_len}")
    return FRAME_HEADER.pack(len(body)) + body


def parse_response(obj: object) -> Any:
    """The result of a reply map; ControlClientError carries a refusal's text."""
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise ProtocolError("control reply is not a {ok: ...} map")
    if obj["ok"]:
        return obj.get("result")
    error, code = obj.get("error"), obj.get("code")
    raise ControlClientError(error if isinstance(error, str) else "the daemon refused the request",
                             code=code if isinstance(code, str) and len(code) <= MAX_OP_LEN else None)


# ---- client ----------------------------------------------------------------------------------

class ControlClient:
    """A blocking connection to the daemon's control socket."""

    def __init__(self, path: Path, config: SocketConfig | None = None, *,
                 data_dir: Path | None = None):
        self.path = Path(path)
        self.config = SocketConfig() if config is None else config
        self.data_dir = self.path.parent.parent if data_dir is None else data_dir
        self._sock: stdsocket.socket | None = None

    def __enter__(self) -> "ControlClient":
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        sock = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        sock.settimeout(self.config.request_timeout_s)
        try:
            sock.connect(os.fspath(self.path))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise DaemonNotRunning(
                f"no daemon is running for data dir {self.data_dir}: start one with "
                f"`dtfm-peer join`") from None
        except PermissionError:
            sock.close()
            raise ControlClientError(
                f"permission denied on control socket {self.path}: the daemon for this data dir "
                f"runs as another user") from None
        except OSError as e:
            sock.close()
            if e.errno in (errno.ENOTSOCK, errno.ENOTDIR):
                raise DaemonNotRunning(f"no daemon is running for data dir {self.data_dir}: "
                                       f"start one with `dtfm-peer join`") from None
            raise ControlClientError(f"cannot reach the daemon at {self.path}: {e}") from None
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, op: str, args: dict[str, Any] | None = None) -> Any:
        """Send one request and return its result; raises ControlClientError on refusal."""
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        frame = encode_frame(ControlRequest(op, args or {}).to_wire(),
                             self.config.max_request_bytes)
        try:
            try:
                self._sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                pass   # the daemon may have sent a refusal before closing: read it below
            head = self._recv_exactly(FRAME_HEADER.size)
            (n,) = FRAME_HEADER.unpack(head)
            if n > self.config.max_response_bytes:
                raise ProtocolError(f"reply of {n} bytes exceeds {self.config.max_response_bytes}")
            reply = unpack_untrusted(self._recv_exactly(n), max_len=self.config.max_response_bytes)
        except TimeoutError:
            raise ControlClientError(f"the daemon for data dir {self.data_dir} did not answer "
                                     f"within {self.config.request_timeout_s:g} s") from None
        except ProtocolError as e:
            raise ControlClientError(f"bad reply from the daemon: {e}") from None
        except (ConnectionError, OSError) as e:
            raise ControlClientError(f"lost the connection to the daemon: {e}") from None
        return parse_response(reply)

    def _recv_exactly(self, n: int) -> bytes:
        assert self._sock is not None
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise ConnectionResetError("the daemon closed the connection")
            buf += chunk
        return bytes(buf)
