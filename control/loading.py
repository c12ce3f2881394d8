"""Loading a module that imports torch without stalling the daemon's event loop."""

from __future__ import annotations

import importlib
import sys

import trio

from dtfm.train import load_torch_libraries

__all__ = ["import_in_thread"]


async def import_in_thread(module: str) -> None:
    """Import `module`, which imports torch, in a worker thread (seconds of work that would
    stall the event loop), torch's native libraries loaded first without the interpreter lock
    (train/native.py); a later import of it is a lookup."""
    if module not in sys.modules:
        await trio.to_thread.run_sync(load_torch_libraries)
        await trio.to_thread.run_sync(importlib.import_module, module)
