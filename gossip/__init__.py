"""dtfm.gossip: membership and failure detection (SWIM with Lifeguard), network measurement,
signed measurement reports with anti-entropy, and the N x N network view."""

from .config import GossipConfig
from .members import Member, MemberState, Update, merge_entry, merge_tables
from .messages import MsgType
from .records import Entry, RecordStore, Report
from .service import GossipService
from .suspicion import remaining_suspicion_time
from .swim import Send, Swim
from .view import NetworkView, build_view

__all__ = [
    "GossipConfig", "GossipService", "Member", "MemberState", "MsgType", "NetworkView", "Entry",
    "Report", "RecordStore", "Send", "Swim", "Update", "build_view", "merge_entry", "merge_tables",
    "remaining_suspicion_time",
]
