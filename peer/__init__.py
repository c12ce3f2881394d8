"""dtfm.peer: the daemon process (`dtfm-peer`): configuration, CLI, control socket, peer
discovery and the services the daemon runs on top of the transport."""

from dtfm.lazy import lazy_exports
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import MAX_CLOCK_JUMP_S, PLANE_PROFILES, ConfigError, DaemonConfig, SocketConfig
    from .control_client import ControlClient, ControlClientError, DaemonNotRunning
    from .paths import DataDir, DataDirError, default_data_dir
    from .runspec import RUN_SPEC_KEYS, KNOB_FLAGS, init_folder, load_run_spec, resolve, send_start, start_request
    from .speed import SPEED_FILE, SelfSpeed, SpeedCache, speed_key
    from .status import format_bytes, plural, quorum_lost, reconfiguration_parts, steps_done

__all__ = [
    "PLANE_PROFILES", "ConfigError", "ControlClient", "ControlClientError", "DaemonConfig", "DaemonNotRunning",
    "DataDir", "DataDirError", "KNOB_FLAGS", "RUN_SPEC_KEYS", "SocketConfig", "default_data_dir", "format_bytes", "init_folder",
    "load_run_spec", "plural", "quorum_lost", "reconfiguration_parts", "resolve", "send_start", "start_request", "steps_done",
    "SPEED_FILE", "SelfSpeed", "SpeedCache", "speed_key", "MAX_CLOCK_JUMP_S",
]

# Each name is imported from its module on first use (dtfm/lazy.py): `dtfm-peer status` loads
# the control client and the status text, not the speed probe's numpy or the server's trio.
# tests/test_layers.py checks that this table, the imports above and __all__ name the same things.
LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".config": ("MAX_CLOCK_JUMP_S", "PLANE_PROFILES", "ConfigError", "DaemonConfig", "SocketConfig"),
    ".control_client": ("ControlClient", "ControlClientError", "DaemonNotRunning"),
    ".paths": ("DataDir", "DataDirError", "default_data_dir"),
    ".runspec": ("RUN_SPEC_KEYS", "KNOB_FLAGS", "init_folder", "load_run_spec", "resolve", "send_start", "start_request"),
    ".speed": ("SPEED_FILE", "SelfSpeed", "SpeedCache", "speed_key"),
    ".status": ("format_bytes", "plural", "quorum_lost", "reconfiguration_parts", "steps_done"),
}
__getattr__, __dir__ = lazy_exports(__name__, LAZY_EXPORTS, globals())
