"""This process's memory as the kernel counts it: resident now and at its peak.

tracemalloc sees only Python's own allocations, not torch's tensors (plain malloc on a CPU) nor
numpy's buffers; the kernel's figures count everything. On Linux they come from
/proc/self/status (VmRSS, and VmHWM, the peak since the process started); elsewhere the peak
is getrusage's ru_maxrss and the current figure is unknown.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcessMemory", "process_memory"]

_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class ProcessMemory:
    rss_bytes: int | None  # resident now (None: not known on this system)
    peak_rss_bytes: int  # resident at the peak, since the process started

    def to_wire(self) -> dict[str, int | None]:
        return {"rss_bytes": self.rss_bytes, "peak_rss_bytes": self.peak_rss_bytes}


def _proc_status(text: str) -> tuple[int | None, int | None]:
    """(VmRSS, VmHWM) in bytes from /proc/PID/status text (None where a line is missing)."""
    got: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields = value.split()
            if len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
                got[key] = int(fields[0]) * 1024
    return got.get("VmRSS"), got.get("VmHWM")


def process_memory() -> ProcessMemory:
    """This process's resident memory now and at its peak."""
    rss = hwm = None
    try:
        rss, hwm = _proc_status(_STATUS.read_text())
    except OSError:
        pass
    if hwm is None:  # ru_maxrss: kilobytes on Linux, bytes on macOS
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        hwm = maxrss if sys.platform == "darwin" else maxrss * 1024
    return ProcessMemory(rss, max(hwm, rss or 0))
