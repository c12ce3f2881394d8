"""Error types of the peer layer.

Every failure caused by malformed or untrusted network input is a `ProtocolError`, so a
connection handler needs exactly one `except` clause to log the reason and close the link.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Malformed, oversized, forged or otherwise unacceptable input from the network."""


class HandshakeError(ProtocolError):
    """The handshake was refused; `str()` is a clear, user-facing reason."""


class RequestTimeout(Exception):
    """A request got no reply within its timeout."""


class ConnectionClosed(Exception):
    """The connection went away; the reason is in `str()`."""


class RemoteError(Exception):
    """The peer answered a request with an error (unknown message type, busy, handler failure)."""


class KeyFileError(Exception):
    """An identity or swarm key file is missing, unreadable or garbled; `str()` says what to do."""
