"""dtfm.net: how bytes move between peers, securely.

Ed25519 identities and the swarm key, the bounded msgpack wire codec, the X25519 handshake,
per-direction AEAD records, the transport and its connections, link shaping (and the test-swarm
link emulator, which is a shaper), and an in-memory network with the same interface for tests.
"""

from .addr import MAX_HOST_LEN, Address, AddressError
from .config import TransportConfig
from .connection import Connection
from .emulation import EmulatedLinks, EmulationConfig
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
from .memnet import LinkModel, MemNetwork, scenario_link, uniform_link
from .memtransport import MemConnection, MemTransport
from .operator import OperatorKey, operator_key_path
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
    "LinkModel", "MemConnection", "MemNetwork", "MemTransport", "PEER_ID_BYTES", "PeerConnection", "PeerTransport",
    "ProtocolError", "Refusals", "RemoteError", "Reply", "RequestTimeout", "Transport", "TransportConfig",
    "get_bool", "get_bytes", "get_dict",
    "get_float", "get_int", "get_list", "get_str", "load_swarm_key", "load_swarm_operators", "new_swarm_key",
    "operator_key_path", "operator_line", "OperatorKey", "pack", "scenario_link",
    "short_id", "swarm_key_fingerprint", "uniform_link", "unpack_untrusted", "verify_signature",
]
