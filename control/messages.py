"""Message types of the control plane on the peer transport. Append only: a number, once
used, keeps its meaning (gossip uses 32-63, the daemon 16-31)."""

from enum import IntEnum

__all__ = ["ControlMsg"]


class ControlMsg(IntEnum):
    ALLOCATION = 64  # request: a signed allocation and its "cert"; reply: accepted once built and connected, or why not
    START = 65       # request: the issuer's go for an epoch every peer accepted
    STOP = 66        # request: end the run at the next step boundary (or abort an epoch)
    STEP = 67        # one-way: a peer's report of a completed step, to the issuer
    FETCH_MANIFEST = 68  # request: the manifest of a stage held at a step; reply: the manifest
    FETCH_CHUNK = 69     # request: one chunk of that stage; reply: the chunk as the payload
    ELECTION = 70    # one-way: a coordinator-election message (control/election/messages.py)
    RUN_STATE = 71   # request: what a peer holds of a run (allocation, steps, stages, checkpoints)
    TENSOR = 72      # request: one tensor of a training step; reply once it is buffered
    TRAIN_OP = 73    # request: an operator's signed start, stop, reschedule or resume forwarded to the coordinator
    COORDINATOR = 74  # request: who is the coordinator? reply: the answering peer's view and certificate
    LEAVE = 75       # request: the sender's own planned leave, to the coordinator; reply once its part is handed off
