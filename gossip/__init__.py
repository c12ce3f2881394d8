"""dtfm.gossip: membership and failure detection (SWIM with Lifeguard) over signed claims,
network measurement, signed measurement reports with anti-entropy, and the N x N network view."""

from .claims import Accusation, Claim, ClaimVerifier, Update
from .measure import compute_speed_ms, measure_rtt
from .config import GossipConfig
from .members import Member, MemberState, merge_entry, merge_tables
from .messages import MsgType
from .records import Entry, RecordStore, Report
from .service import GossipService
from .suspicion import remaining_suspicion_time
from .swim import Send, Swim
from .view import NetworkView, build_view

__all__ = [
    "Accusation", "Claim", "ClaimVerifier", "GossipConfig", "GossipService", "Member", "MemberState",
    "MsgType", "NetworkView", "Entry", "Report", "RecordStore", "Send", "Swim", "Update", "build_view",
    "compute_speed_ms", "measure_rtt", "merge_entry", "merge_tables", "remaining_suspicion_time",
]
