"""The data plane: the training `Comm` between daemons over the peer transport.

`TransportComm` (comm.py) owns a `Sender` (send.py: sequence numbers, a queue and a window per
destination) and a `Receiver` (receive.py: checks against the plan, a bounded buffer per
neighbour); `TensorRouter` (router.py) owns the transport's TENSOR handler; wire.py is the TENSOR
message and its replies, config.py the flow-control settings. docs/control.md ("The Comm over
the transport") has the protocol.
"""

from dtfm.lazy import lazy_exports
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .comm import TransportComm
    from .router import TensorRouter
    from .config import ENTRY_OVERHEAD_BYTES, CommConfig

__all__ = ["ENTRY_OVERHEAD_BYTES", "CommConfig", "TensorRouter", "TransportComm"]

# Where each name above is defined. A name is imported from its module on first use (PEP 562):
# a command that needs only light parts of the package (`dtfm-peer status` reads the daemon's
# config classes) does not load torch, scipy or the rest. tests/test_layers.py checks that this
# table, the imports above and __all__ name the same things.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".comm": ("TransportComm",),
    ".router": ("TensorRouter",),
    ".config": ("ENTRY_OVERHEAD_BYTES", "CommConfig"),
}
__getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())
