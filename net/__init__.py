"""dtfm.net: how bytes move between peers, securely.

Ed25519 identities and the swarm key, the bounded msgpack wire codec, the X25519 handshake,
per-direction AEAD records, the transport and its connections, link shaping (and the test-swarm
link emulator, which is a shaper), and an in-memory network with the same interface for tests.
"""

from typing import TYPE_CHECKING

from dtfm.lazy import lazy_exports

if TYPE_CHECKING:
    from .addr import MAX_HOST_LEN, Address, AddressError
    from .config import EmulationConfig, TransportConfig
    from .connection import Connection
    from .emulation import EmulatedLinks
    from .dispatch import Refusals
    from .errors import ConnectionClosed, HandshakeError, KeyFileError, ProtocolError, RemoteError, RequestTimeout
    from .identity import (
                           IDENTITY_FILE,
                           PEER_ID_BYTES,
                           Identity,
                           load_swarm_key,
                           load_swarm_operators,
                           new_swarm_key,
                           operator_line,
                           short_id,
                           swarm_key_fingerprint,
                           verify_signature,
    )
    from .interface import Handler, PeerConnection, PeerTransport, Reply
    from .lograte import LogLimiter
    from .memnet import LinkModel, MemNetwork, scenario_link, uniform_link
    from .memtransport import MemConnection, MemTransport
    from .operator import OperatorKey, operator_key_path
    from .ratelimit import TokenBuckets
    from .shaping import LinkShape, LinkShaper
    from .transport import Transport
    from .wire import (
                           get_bool,
                           get_bytes,
                           get_dict,
                           get_float,
                           get_int,
                           get_list,
                           get_str,
                           pack,
                           unpack_untrusted,
    )

__all__ = [
    "Address", "AddressError", "Connection", "ConnectionClosed", "EmulatedLinks", "EmulationConfig", "Handler",
    "HandshakeError", "IDENTITY_FILE", "Identity", "KeyFileError", "LinkShape", "LinkShaper", "MAX_HOST_LEN",
    "LinkModel", "LogLimiter", "MemConnection", "MemNetwork", "MemTransport", "PEER_ID_BYTES", "PeerConnection", "PeerTransport",
    "ProtocolError", "Refusals", "RemoteError", "Reply", "RequestTimeout", "TokenBuckets", "Transport",
    "TransportConfig",
    "get_bool", "get_bytes", "get_dict",
    "get_float", "get_int", "get_list", "get_str", "load_swarm_key", "load_swarm_operators", "new_swarm_key",
    "operator_key_path", "operator_line", "OperatorKey", "pack", "scenario_link",
    "short_id", "swarm_key_fingerprint", "uniform_link", "unpack_untrusted", "verify_signature",
]

# Where each name above is defined. A name is imported from its module on first use (PEP 562):
# `dtfm-peer status` reads the daemon's settings and talks to its socket without loading the
# transport (trio, numpy). tests/test_layers.py checks that this table, the imports above and
# __all__ name the same things.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".addr": ("MAX_HOST_LEN", "Address", "AddressError"),
    ".config": ("EmulationConfig", "TransportConfig"),
    ".connection": ("Connection",),
    ".emulation": ("EmulatedLinks",),
    ".dispatch": ("Refusals",),
    ".errors": (
        "ConnectionClosed", "HandshakeError", "KeyFileError", "ProtocolError", "RemoteError", "RequestTimeout",
    ),
    ".identity": (
        "IDENTITY_FILE", "PEER_ID_BYTES", "Identity", "load_swarm_key", "load_swarm_operators", "new_swarm_key",
        "operator_line", "short_id", "swarm_key_fingerprint", "verify_signature",
    ),
    ".interface": ("Handler", "PeerConnection", "PeerTransport", "Reply"),
    ".lograte": ("LogLimiter",),
    ".memnet": ("LinkModel", "MemNetwork", "scenario_link", "uniform_link"),
    ".memtransport": ("MemConnection", "MemTransport"),
    ".operator": ("OperatorKey", "operator_key_path"),
    ".ratelimit": ("TokenBuckets",),
    ".shaping": ("LinkShape", "LinkShaper"),
    ".transport": ("Transport",),
    ".wire": (
        "get_bool", "get_bytes", "get_dict", "get_float", "get_int", "get_list", "get_str", "pack",
        "unpack_untrusted",
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())
