"""torch's native libraries, loaded before `import torch` with the interpreter lock released.

A daemon imports torch when it builds its first stage, in a worker thread, while its event
loop goes on answering peers. But the dynamic loader maps and initialises torch's libraries
(libtorch_cpu alone is 400 MB, with thousands of static initialisers) inside one C call made
with the interpreter lock held, and the event loop stands still for it: 0.5-1.5 s on a loaded
2-core machine, long enough for a council to lose its coordinator. `load_torch_libraries`
loads them first through a foreign call (ctypes releases the lock around it); the import that
follows finds them in memory. No torch is imported here.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys

__all__ = ["load_torch_libraries"]

logger = logging.getLogger(__name__)

# The library `torch._C` links against; the loader brings its own dependencies along (libtorch,
# libtorch_cpu or the CUDA ones, libc10, the OpenMP runtime), found beside it.
TORCH_LIBRARY = "libtorch_python.so"


def load_torch_libraries() -> bool:
    """Load torch's native libraries without holding the interpreter lock (blocking: call it
    in a worker thread); whether they are loaded. False, with nothing done, where torch is not
    installed, on a platform other than Linux, or when the loader refuses (the import then
    loads them itself, as it always does)."""
    if not sys.platform.startswith("linux") or "torch" in sys.modules:
        return "torch" in sys.modules
    spec = importlib.util.find_spec("torch")  # (finds the package; does not import it)
    if spec is None or spec.origin is None:
        return False
    path = os.path.join(os.path.dirname(spec.origin), "lib", TORCH_LIBRARY)
    if not os.path.exists(path):
        return False
    try:
        libc = ctypes.CDLL(None)
        dlopen = libc.dlopen
    except (OSError, AttributeError):
        return False
    dlopen.restype = ctypes.c_void_p
    dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    handle = dlopen(os.fsencode(path), os.RTLD_NOW | os.RTLD_LOCAL)  # (kept open: torch uses it)
    if not handle:
        logger.debug("torch's libraries were not loaded ahead (%s): the import loads them", path)
    return bool(handle)
