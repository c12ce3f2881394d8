"""The data plane: the training `Comm` between daemons over the peer transport.

`TransportComm` (comm.py) owns a `Sender` (send.py: sequence numbers, a queue and a window per
destination) and a `Receiver` (receive.py: checks against the plan, a bounded buffer per
neighbour); `TensorRouter` (comm.py) owns the transport's TENSOR handler; wire.py is the TENSOR
message and its replies, config.py the flow-control settings. docs/control.md ("The Comm over
the transport") has the protocol.
"""

from .comm import TensorRouter, TransportComm
from .config import ENTRY_OVERHEAD_BYTES, CommConfig

__all__ = ["ENTRY_OVERHEAD_BYTES", "CommConfig", "TensorRouter", "TransportComm"]
