"""dtfm.swarm: many peers on one machine. `dtfm-swarm` starts daemons under emulated
inter-region links, drives them over their control sockets, keeps a run dir and reports."""

from .cli import main
from .state import SwarmError, SwarmState

__all__ = ["SwarmError", "SwarmState", "main"]
