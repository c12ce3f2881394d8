"""The election's bounds on the wire and the check of a configuration, shared by its messages
and its certificates."""

from __future__ import annotations

import itertools

from dtfm.net import PEER_ID_BYTES

__all__ = ["MAX_TERM", "MAX_VOTERS", "SIGNATURE_BYTES", "check_voters"]

MAX_TERM = 2**63 - 1  # terms, epochs and heartbeat sequence numbers
MAX_VOTERS = 4096  # as many as an allocation may name
SIGNATURE_BYTES = 64  # an Ed25519 signature (a vote)


def check_voters(voters: object) -> tuple[bytes, ...]:
    """`voters` as a tuple: 1 to MAX_VOTERS peer ids, sorted, no repeats; else TypeError or ValueError."""
    if not isinstance(voters, (tuple, list)):
        raise TypeError(f"voters must be a sequence of peer ids, got {type(voters).__name__}")
    out = tuple(voters)
    if not 1 <= len(out) <= MAX_VOTERS:
        raise ValueError(f"a configuration has 1 to {MAX_VOTERS} voters, got {len(out)}")
    for v in out:
        if type(v) is not bytes or len(v) != PEER_ID_BYTES:
            raise ValueError(f"voter must be a {PEER_ID_BYTES}-byte peer id, got {v!r:.80}")
    if any(a >= b for a, b in itertools.pairwise(out)):
        raise ValueError("voters must be sorted, without repeats")
    return out
