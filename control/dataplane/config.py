"""The data plane's flow-control settings (`CommConfig`), shared by its sender and receiver.

The protocol they bound is in docs/control.md ("The Comm over the transport").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtfm.train import MessageRules

__all__ = ["ENTRY_OVERHEAD_BYTES", "CommConfig"]

MiB = 1 << 20

# What a buffered tensor costs beyond its bytes (tensor object, header, queue entry); it also
# bounds how many empty tensors a buffer can hold.
ENTRY_OVERHEAD_BYTES = 1024


@dataclass(frozen=True)
class CommConfig:
    """Flow control of tensor traffic. Every peer of a swarm uses the same values."""

    # Unacknowledged bytes a sender keeps in flight to one peer (but never less than two of the
    # tensor being sent): more keeps a long, fast link full (bandwidth x round trip); less bounds
    # what a receiver holds in handlers waiting for room.
    window_bytes: int = 64 * MiB
    # Unacknowledged tensors to one peer. Across a link of latency L a pipeline of M > W
    # micro-batches pays a round trip per W of them (the scheduler's simulator counts it, so it
    # picks M <= W on latency-bound links). A wider window lets it pick more micro-batches, which
    # the simulator predicts faster but which measured no faster on a loaded machine (each
    # message's fixed cost is not modelled: docs/figures.md). The transport allows 64 incomplete
    # payloads and 64 handlers per connection, shared with gossip and control: at most half.
    window_messages: int = 8
    # A neighbour's receive buffer holds this many of its largest message (or what it sends in a
    # row, if more): above 1 the next tensor lands while the worker computes on this one.
    buffer_factor: float = 2.0
    # Cap on one neighbour's receive buffer (never below its largest message): bounds memory
    # when a neighbour sends much in a row (a ring all-reduce step of a large model).
    max_buffer_bytes: int = 1024 * MiB
    # Copies of sent tensors kept for reuse by later sends of the same size, in bytes: a fresh
    # large buffer costs a page fault per page, about four times the copy into a warm one. It
    # holds only what sends have used: a peer that sends little keeps little. 0 keeps none.
    send_pool_bytes: int = 1024 * MiB
    # Tensors `isend` may queue for one peer; beyond it the send fails (a stuck peer, or a bug).
    max_queued_messages: int = 1 << 16
    # A sent tensor not acknowledged within this long fails (transfer and wait for room included).
    ack_timeout_s: float = 300.0
    # How long a receiving handler waits for room in the buffer (or for earlier sequence
    # numbers) before it refuses the tensor; a worker slower than this fails the step.
    handler_wait_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.window_bytes < 1 or not 1 <= self.window_messages <= 32:
            raise ValueError("window_bytes must be >= 1 and window_messages in 1..32")
        if not self.buffer_factor >= 1.0:
            raise ValueError("buffer_factor must be >= 1")
        if self.max_buffer_bytes < 1 or self.max_queued_messages < 1:
            raise ValueError("max_buffer_bytes and max_queued_messages must be >= 1")
        if self.send_pool_bytes < 0:
            raise ValueError("send_pool_bytes must be >= 0")
        if not self.handler_wait_timeout_s > 0 or not self.ack_timeout_s > self.handler_wait_timeout_s:
            raise ValueError("need 0 < handler_wait_timeout_s < ack_timeout_s")

    @classmethod
    def default(cls) -> CommConfig:
        return cls()

    @classmethod
    def test(cls) -> CommConfig:
        """Small windows and short timeouts, so back-pressure and failures show within seconds."""
        return cls(window_bytes=8 * MiB, window_messages=4, max_buffer_bytes=64 * MiB, max_queued_messages=4096,
                   ack_timeout_s=10.0, handler_wait_timeout_s=5.0)

    def buffer_limit(self, rules: MessageRules, src: bytes) -> int:
        """Bytes (with per-entry overhead) buffered at most for tensors from `src`."""
        largest = rules.max_message_bytes(src) + ENTRY_OVERHEAD_BYTES
        msgs, nbytes = rules.burst(src)
        want = max(math.ceil(self.buffer_factor * largest), nbytes + msgs * ENTRY_OVERHEAD_BYTES)
        return max(largest, min(want, self.max_buffer_bytes))
