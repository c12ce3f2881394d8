"""The data plane: the training `Comm` between daemons over the peer transport.

`TransportComm` (comm.py) owns a `Sender` (send.py: sequence numbers, a queue and a window per
destination) and a `Receiver` (receive.py: checks against the plan, a bounded buffer per
neighbour); `TensorRouter` (comm.py) owns the transport's TENSOR handler; wire.py is the TENSOR
message and its replies, config.py the flow-control settings. docs/control.md ("The Comm over
the transport") has the protocol.
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .comm import TensorRouter, TransportComm
    from .config import ENTRY_OVERHEAD_BYTES, CommConfig

__all__ = ["ENTRY_OVERHEAD_BYTES", "CommConfig", "TensorRouter", "TransportComm"]

# Where each name above is defined. A name is imported from its module on first use (PEP 562):
# a command that needs only light parts of the package (`dtfm-peer status` reads the daemon's
# config classes) does not load torch, scipy or the rest. tests/test_layers.py checks that this
# table, the imports above and __all__ name the same things.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".comm": ("TensorRouter", "TransportComm"),
    ".config": ("ENTRY_OVERHEAD_BYTES", "CommConfig"),
}
_MODULE_OF = {name: module for module, names in LAZY_EXPORTS.items() for name in names}


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
