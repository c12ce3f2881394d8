"""dtfm.gossip: membership and failure detection (SWIM with Lifeguard) over signed claims,
network measurement (network coordinates, capacities, links measured on demand), signed
measurement reports with anti-entropy, and the N x N network view (measured or estimated)."""

from typing import TYPE_CHECKING

from dtfm.lazy import lazy_exports

if TYPE_CHECKING:
    from .claims import Accusation, Claim, ClaimVerifier, Update
    from .measure import compute_speed_ms, measure_rtt
    from .reference import REFERENCE_BLOCK, cpu_share, host_fingerprint, mean_ms, reference_block, time_block_ms
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
    "REFERENCE_BLOCK", "cpu_share", "host_fingerprint", "mean_ms", "compute_speed_ms", "measure_rtt", "reference_block", "time_block_ms", "merge_entry", "merge_tables", "remaining_suspicion_time",
    "DISAGREEMENT_RATIO", "Coordinate", "Vivaldi",
]

# Where each name above is defined. A name is imported from its module on first use (PEP 562):
# `dtfm-peer status` reads GossipConfig without loading the service (trio, numpy).
# tests/test_layers.py checks that this table, the imports above and __all__ name the same things.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".claims": ("Accusation", "Claim", "ClaimVerifier", "Update"),
    ".measure": ("compute_speed_ms", "measure_rtt"),
    ".reference": ("REFERENCE_BLOCK", "cpu_share", "host_fingerprint", "mean_ms", "reference_block", "time_block_ms"),
    ".config": ("GossipConfig",),
    ".members": ("Member", "MemberState", "merge_entry", "merge_tables"),
    ".messages": ("MsgType",),
    ".records": ("Entry", "RecordStore", "Report"),
    ".service": ("GossipService",),
    ".suspicion": ("remaining_suspicion_time",),
    ".swim": ("Send", "Swim"),
    ".view": ("DISAGREEMENT_RATIO", "NetworkView", "build_view"),
    ".vivaldi": ("Coordinate", "Vivaldi"),
}
__getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())
