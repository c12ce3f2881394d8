"""dtfm.peer: the daemon process (`dtfm-peer`): configuration, CLI, control socket, peer
discovery and the services the daemon runs on top of the transport."""

from .config import ConfigError, SocketConfig, DaemonConfig
from .socket import ControlClient, ControlClientError, DaemonNotRunning
from .paths import DataDir, DataDirError, default_data_dir

__all__ = [
    "ConfigError", "ControlClient", "ControlClientError", "SocketConfig", "DaemonConfig", "DaemonNotRunning",
    "DataDir", "DataDirError", "default_data_dir",
]
