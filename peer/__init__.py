"""dtfm.peer"""

from .errors import ConnectionClosed, HandshakeError, KeyFileError, ProtocolError, RequestTimeout
from .identity import Identity, load_swarm_key, new_swarm_key, verify_signature
from .wire import (
    check_tensor,
    get_bytes,
    get_float,
    get_int,
    get_list,
    get_str,
    pack,
    tensor_header,
    unpack_untrusted,
)
from .errors import RemoteError
from .shaping import LinkShape, LinkShaper
from .transport import Connection, Reply, Transport, TransportConfig
from .addr import Address
# The daemon (dtfm.peer.daemon, .config, .cli) sits above gossip and the trainer; it is not
# imported here, so that gossip can import this package's transport layer without a cycle.
