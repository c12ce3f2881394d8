"""Run a daemon process: data dir, lock, keys, transport, signals. Used by `dtfm-peer join`."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import stat
from collections.abc import Callable, Sequence

import trio

from dtfm.net import IDENTITY_FILE, Identity, LinkShaper, Transport, load_swarm_key, swarm_key_fingerprint
from dtfm.train import limit_heap_caching

from .config import ConfigError, DaemonConfig
from .daemon import Daemon
from .paths import DataDir, DataDirLock, default_data_dir
from .services import build_shaper, services_setup

logger = logging.getLogger(__name__)

# Called with the daemon before it runs; later parts register their services here.
DaemonSetup = Callable[[Daemon], None]

# DTFM_PRELOAD=torch,scipy: import these at start, as every daemon did before they were loaded on
# first use (torch with the first stage, scipy with the first schedule). The baseline of
# bench/idle.py; or a daemon that should pay their memory up front rather than pause its event
# loop while they load (docs/daemon.md, "Memory").
PRELOAD_ENV = "DTFM_PRELOAD"
PRELOADS = {"torch": "dtfm.control.epoch.stages", "scipy": "scipy.optimize"}


async def run_until_signal(daemon: Daemon) -> None:
    """Run the daemon; SIGINT or SIGTERM make it leave cleanly."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                async for signum in signals:
                    daemon.request_leave(f"received {signal.Signals(signum).name}")

            nursery.start_soon(watch)
            await daemon.run()
            nursery.cancel_scope.cancel()


def build_daemon(config: DaemonConfig, data_dir: DataDir, shaper: LinkShaper | None = None) -> Daemon:
    if config.peer.swarm_key_file is None:
        raise ConfigError("joining needs the swarm key: pass --swarm-key FILE (make one with "
                          "`dtfm-peer swarm-key new --out FILE` and copy it to every peer)")
    swarm_key = load_swarm_key(config.peer.swarm_key_file)
    warn_if_readable_by_others(config.peer.swarm_key_file)
    existed = (data_dir.root / IDENTITY_FILE).exists()
    identity = Identity.load_or_create(data_dir.root)
    if not existed:
        logger.info("created identity %s in %s", identity.short_id, data_dir.root)
    fingerprint = swarm_key_fingerprint(swarm_key)
    logger.info("peer %s, swarm key fingerprint %s", identity.short_id, fingerprint)
    transport = Transport(identity, swarm_key, config.transport, region=config.peer.region,
                          shaper=shaper)
    daemon = Daemon(config, identity, transport, data_dir)
    # Not secret; lets two operators compare keys when a handshake is refused.
    daemon.add_status_provider("swarm_key_fingerprint", lambda: fingerprint)
    return daemon


def preload(names: str) -> None:
    """Import the modules `names` (comma-separated keys of PRELOADS) names; ConfigError for
    another name."""
    for name in filter(None, (n.strip() for n in names.split(","))):
        module = PRELOADS.get(name)
        if module is None:
            raise ConfigError(f"{PRELOAD_ENV}: {name!r} is not one of {', '.join(PRELOADS)}")
        importlib.import_module(module)
        logger.info("%s loaded at start (%s)", name, PRELOAD_ENV)


def warn_if_readable_by_others(path: str | os.PathLike[str]) -> bool:
    """Log a warning when a secret file may be read by its group or by others; True if so."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return False
    if not mode & 0o077:
        return False
    logger.warning("swarm key file %s has mode %04o: other users can read the key and join "
                   "the swarm; fix it with `chmod 600 %s`", path, mode, path)
    return True


def run_daemon(config: DaemonConfig, setups: Sequence[DaemonSetup] = (), *,
               services: bool = True) -> int:
    """Run until told to leave; returns the exit status. User errors raise (see cli).

    `services`: run gossip and the control plane (dtfm.peer.services). Each of `setups` is
    called with the daemon before it starts, to add services, status providers and control ops."""
    data_dir = DataDir((config.peer.data_dir or default_data_dir()).absolute())
    data_dir.ensure()
    data_dir.check_socket_path()
    with DataDirLock(data_dir):
        # Blocks of 1 MiB or more (a bandwidth probe's buffers, a transfer's) are mapped on their
        # own and go back to the system when freed, from the start, not once a stage trains: an
        # idle daemon keeps no freed megabyte per connection it probed (train/memory.py).
        limit_heap_caching()
        preload(os.environ.get(PRELOAD_ENV, ""))
        shaper = build_shaper(config)
        daemon = build_daemon(config, data_dir, shaper)
        if services:
            services_setup(config, shaper)(daemon)
        for setup in setups:
            setup(daemon)
        trio.run(run_until_signal, daemon)
    return 0

