"""dtfm.gossip: membership and failure detection (SWIM with Lifeguard) over signed claims,
network measurement (network coordinates, capacities, links measured on demand), signed
measurement reports with anti-entropy, and the N x N network view (measured or estimated)."""

from .claims import Accusation, Claim, ClaimVerifier, Update
from .measure import measure_rtt
from .config import GossipConfig
from .members import Member, MemberState, merge_entry, merge_tables
from .messages import MsgType
from .records import Entry, RecordStore, Report
from .service import GossipService
from .suspicion import remaining_suspicion_time
from .swim import Send, Swim
from .view import DISAGREEMENT_RATIO, NetworkView, build_view
from .vivaldi import Coordinate, Vivaldi

__all__ = [
    "Accusation", "Claim", "ClaimVerifier", "GossipConfig", "GossipService", "Member", "MemberState",
    "MsgType", "NetworkView", "Entry", "Report", "RecordStore", "Send", "Swim", "Update", "build_view",
    "measure_rtt", "merge_entry", "merge_tables", "remaining_suspicion_time", "DISAGREEMENT_RATIO", "Coordinate",
    "Vivaldi",
]
