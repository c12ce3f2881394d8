"""The signed allocation (allocation.py) and the bounds, checks and wire forms of its fields
(fields.py). The protocol is in docs/control.md."""

from .allocation import (
    ALLOCATION_DOMAIN,
    FORMAT_VERSION,
    MAX_ALLOCATION_BYTES,
    REFUSAL_CODES,
    AcceptContext,
    Allocation,
    Refusal,
    SignedAllocation,
    check_allocation,
)
from .fields import RUN_ID_BYTES, Holding

__all__ = [
    "ALLOCATION_DOMAIN",
    "FORMAT_VERSION",
    "MAX_ALLOCATION_BYTES",
    "REFUSAL_CODES",
    "RUN_ID_BYTES",
    "AcceptContext",
    "Allocation",
    "Holding",
    "Refusal",
    "SignedAllocation",
    "check_allocation",
]
