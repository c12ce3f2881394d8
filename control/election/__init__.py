"""The coordinator election: who hands out allocations, term by term (protocol: docs/election.md).

    state.py     ElectionState, the sans-IO machine, its roles and actions
    config.py    ElectionConfig and its profiles
    messages.py  the six election messages and their wire form
    certificate.py  signed votes, the Certificate of an election, and its (cached) check
    discovery.py the question "who is the coordinator?", its answer, and why none was found
    limits.py    the wire's bounds (MAX_TERM, MAX_VOTERS) and the check of a configuration
    council.py   the council: its operator's root, its one-voter changes, and their check
    store.py     the durable term and vote (file or memory)
    service.py   ElectionService, the trio driver of ElectionState inside a daemon
    (its deterministic simulated network, for tests and bench/election.py, is
    dtfm.control.testing.election_sim)
"""

from dtfm.lazy import lazy_exports
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .certificate import Certificate, CertificateCheck, config_digest, quorum, vote_payload
    from .config import ElectionConfig
    from .council import COUNCIL_SIZES, MAX_COUNCIL, Council, CouncilLink
    from .discovery import CoordinatorAnswer, Discovery
    from .messages import (
        MAX_TERM,
        MAX_VOTERS,
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
        PreviousConfiguration,
        SteppedDown,
        VoteSigner,
    )
    from .store import ElectionStore, ElectionStoreError, FileElectionStore, MemoryElectionStore

__all__ = [
    "COUNCIL_SIZES",
    "MAX_COUNCIL",
    "MAX_TERM",
    "MAX_VOTERS",
    "BecameCoordinator",
    "Certificate",
    "CertificateCheck",
    "CoordinatorAnswer",
    "CoordinatorKnown",
    "Council",
    "CouncilLink",
    "Discovery",
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
    "PreviousConfiguration",
    "RequestVote",
    "SteppedDown",
    "Vote",
    "VoteSigner",
    "config_digest",
    "decode_election",
    "quorum",
    "vote_payload",
]

# Where each name above is defined. A name is imported from its module on first use (PEP 562):
# a command that needs only light parts of the package (`dtfm-peer status` reads the daemon's
# config classes) does not load torch, scipy or the rest. tests/test_layers.py checks that this
# table, the imports above and __all__ name the same things.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".certificate": ("Certificate", "CertificateCheck", "config_digest", "quorum", "vote_payload"),
    ".config": ("ElectionConfig",),
    ".council": ("COUNCIL_SIZES", "MAX_COUNCIL", "Council", "CouncilLink"),
    ".discovery": ("CoordinatorAnswer", "Discovery"),
    ".messages": (
        "MAX_TERM", "MAX_VOTERS", "ElectionMessage", "Heartbeat", "HeartbeatAck", "PreVote", "PreVoteReply", "RequestVote", "Vote",
        "decode_election",
    ),
    ".service": ("ElectionEvent", "ElectionService"),
    ".state": (
        "BecameCoordinator", "CoordinatorKnown", "ElectionAction", "ElectionRole", "ElectionSend",
        "ElectionState", "Persist", "PreviousConfiguration", "SteppedDown", "VoteSigner",
    ),
    ".store": ("ElectionStore", "ElectionStoreError", "FileElectionStore", "MemoryElectionStore"),
}
__getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())
