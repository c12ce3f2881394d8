"""peer/procmem.py: the process's resident memory as the kernel counts it."""

import numpy as np

from dtfm.peer.procmem import _proc_status, process_memory


def test_proc_status_lines_are_read_in_bytes_and_odd_ones_left_out():
    text = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t4\n"
    assert _proc_status(text) == (1024 * 1024, 2048 * 1024)
    assert _proc_status("VmRSS:\tmany kB\nVmHWM:\t12 MB\n") == (None, None)


def test_touching_memory_raises_the_resident_figure_and_the_peak_keeps_it():
    before = process_memory()
    assert before.rss_bytes is not None and 0 < before.rss_bytes <= before.peak_rss_bytes
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, every page touched
    during = process_memory()
    assert during.rss_bytes >= before.rss_bytes + (48 << 20)
    del block
    after = process_memory()
    # (the kernel batches its per-thread page counts: VmHWM may lag VmRSS by a few hundred kB)
    assert after.peak_rss_bytes >= during.rss_bytes - (4 << 20)
    assert after.peak_rss_bytes >= before.rss_bytes + (48 << 20)
    assert after.to_wire() == {"rss_bytes": after.rss_bytes, "peak_rss_bytes": after.peak_rss_bytes}
