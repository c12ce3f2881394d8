"""dtfm.peer: the daemon process (`dtfm-peer`): configuration, CLI, control socket, peer
discovery and the services the daemon runs on top of the transport."""

from .config import MAX_CLOCK_JUMP_S, PLANE_PROFILES, ConfigError, DaemonConfig, SocketConfig
from .paths import DataDir, DataDirError, default_data_dir
from .runspec import RUN_SPEC_KEYS, KNOB_FLAGS, init_folder, load_run_spec, resolve, send_start, start_request
from .socket import ControlClient, ControlClientError, DaemonNotRunning
from .speed import SPEED_FILE, SelfSpeed, SpeedCache, speed_key
from .status import format_bytes, plural, reconfiguration_parts, steps_done

__all__ = [
    "PLANE_PROFILES", "ConfigError", "ControlClient", "ControlClientError", "DaemonConfig", "DaemonNotRunning",
    "DataDir", "DataDirError", "KNOB_FLAGS", "RUN_SPEC_KEYS", "SocketConfig", "default_data_dir", "format_bytes", "init_folder",
    "load_run_spec", "plural", "reconfiguration_parts", "resolve", "send_start", "start_request", "steps_done",
    "SPEED_FILE", "SelfSpeed", "SpeedCache", "speed_key", "MAX_CLOCK_JUMP_S",
]
