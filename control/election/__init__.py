"""The coordinator election: who hands out allocations, term by term (protocol: docs/control.md).

    state.py     ElectionState, the sans-IO machine, its roles and actions
    config.py    ElectionConfig and its profiles
    messages.py  the six election messages and their wire form
    store.py     the durable term and vote (file or memory)
    service.py   ElectionService, the trio driver of ElectionState inside a daemon
    sim.py       a deterministic simulated network of ElectionState nodes, for tests and
                 bench/election.py; not imported here (import dtfm.control.election.sim)
"""

from .config import ElectionConfig
from .messages import (
    ElectionMessage,
    Heartbeat,
    HeartbeatAck,
    PreVote,
    PreVoteReply,
    RequestVote,
    Vote,
    decode_election,
)
from .service import ElectionEvent, ElectionService
from .state import (
    BecameCoordinator,
    CoordinatorKnown,
    ElectionAction,
    ElectionRole,
    ElectionSend,
    ElectionState,
    Persist,
    SteppedDown,
)
from .store import ElectionStore, ElectionStoreError, FileElectionStore, MemoryElectionStore

__all__ = [
    "BecameCoordinator",
    "CoordinatorKnown",
    "ElectionAction",
    "ElectionConfig",
    "ElectionEvent",
    "ElectionMessage",
    "ElectionRole",
    "ElectionSend",
    "ElectionService",
    "ElectionState",
    "ElectionStore",
    "ElectionStoreError",
    "FileElectionStore",
    "Heartbeat",
    "HeartbeatAck",
    "MemoryElectionStore",
    "Persist",
    "PreVote",
    "PreVoteReply",
    "RequestVote",
    "SteppedDown",
    "Vote",
    "decode_election",
]
