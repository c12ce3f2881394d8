"""`PayloadBudget`: the bytes of incomplete incoming payloads one transport holds across all of
its connections (sans-IO).

Each connection bounds its own incomplete payloads (`max_inflight_payloads` / `_bytes`); with
many connections those limits add up. The budget is shared by every connection of a transport:
a payload whose announced size does not fit is refused instead of allocated, and its bytes are
returned when the payload completes, is aborted, or its connection closes.
"""

from __future__ import annotations

__all__ = ["PayloadBudget"]


class PayloadBudget:
    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError("limit_bytes must be >= 0")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0

    def reserve(self, n: int) -> bool:
        """Take n bytes if they fit; False (and nothing taken) if not."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if self.used_bytes + n > self.limit_bytes:
            return False
        self.used_bytes += n
        return True

    def release(self, n: int) -> None:
        """Return n bytes taken by `reserve`."""
        if not 0 <= n <= self.used_bytes:
            raise ValueError(f"releasing {n} bytes of {self.used_bytes} reserved")
        self.used_bytes -= n
