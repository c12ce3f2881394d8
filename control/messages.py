"""Message types of the control plane on the peer transport. Append only: a number, once
used, keeps its meaning (gossip uses 32-63, the daemon 16-31)."""

from enum import IntEnum

__all__ = ["ControlMsg"]


class ControlMsg(IntEnum):
    ALLOCATION = 64  # request: a signed allocation; reply: accepted once built and connected, or why not
    START = 65       # request: the issuer's go for an epoch every peer accepted
    STOP = 66        # request: end the run at the next step boundary (or abort an epoch)
    STEP = 67        # one-way: a peer's report of a completed step, to the issuer
    TENSOR = 72      # request: one tensor of a training step; reply once it is buffered
