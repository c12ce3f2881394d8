"""What the daemon runs besides discovery: gossip membership and measurement, link emulation,
and the control plane that trains (the coordinator election, allocations, the stage worker,
reconfiguration, `train start` / `stop` / `reschedule`).

`build_shaper` makes the transport's LinkShaper from the [emulation] settings (before the
transport exists); `gossip_setup` returns the setup hook that runs a GossipService with the
[gossip] settings inside the daemon's nursery, shows it under "gossip" in `dtfm-peer status`,
and answers the `emulate` control op (`dtfm-swarm partition` / `heal`). Both sections hold the
lower layer's own config (EmulationConfig, GossipConfig), passed on as it is.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from dtfm.control import ControlPlane, PlaneConfig, TrainError, TrainRequest
from dtfm.gossip import GossipConfig, GossipService
from dtfm.net import EmulatedLinks
from dtfm.scenarios import ScenarioError, load_scenario

from .config import ConfigError, DaemonConfig
from .socket import ControlCommandError

logger = logging.getLogger(__name__)

MAX_CUT_PEERS = 4096


def build_shaper(config: DaemonConfig):
    """The EmulatedLinks for this peer, or None when no scenario is emulated."""
    em = config.emulation
    if not em.scenario:
        return None

    try:
        scenario = load_scenario(em.scenario)
    except ScenarioError as e:
        raise ConfigError(f"--emulate: {e}") from None
    region = config.peer.region
    names = [r.name for r in scenario.regions]
    if region not in names:
        raise ConfigError(f"--emulate {em.scenario}: this peer's --region {region or '(none)'!r} "
                          f"is not in the scenario; choose one of {', '.join(names)}")
    return EmulatedLinks(scenario, region, em.settings)


def gossip_config(config: DaemonConfig) -> GossipConfig:
    """The [gossip] settings, max_sync_bytes capped so a sync message fits in one control
    frame of the transport."""
    settings = config.gossip.settings
    limit = config.transport.max_control_frame_bytes // 2
    return settings.with_(max_sync_bytes=limit) if settings.max_sync_bytes > limit else settings


def gossip_setup(config: DaemonConfig, shaper=None):
    """A setup hook for run_daemon: gossip runs as a daemon service."""

    def setup(daemon) -> None:
        holder: dict[str, Any] = {}

        async def run_gossip(daemon, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
            compute_ms = config.gossip.compute_ms or None
            service = GossipService(daemon.transport, daemon.identity, gossip_config(config),
                                    region=config.peer.region, compute_ms=compute_ms,
                                    address=_advertised(daemon))
            holder["service"] = service
            daemon.discovery.on_advertise(lambda a: service.set_address(a.host, a.port))
            data = str(config.trainer.data) if config.trainer.data is not None else None
            plane = ControlPlane(daemon.transport, daemon.identity, service, daemon.data_dir.root,
                                 PlaneConfig(torch_threads=config.trainer.torch_threads, data_path=data))
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run)
                await nursery.start(plane.run)
                holder["plane"] = plane
                task_status.started()
                bootstrap = [(a.host, a.port) for a in config.peer.bootstrap
                             if a != daemon.listen_address]
                # Bootstrap peers may still be starting: retry with backoff until one answers
                # or gossip has found the swarm some other way.
                delay_s = config.discovery.retry_initial_s
                while bootstrap:
                    reached = await service.join(bootstrap)
                    if reached or len(service.live_peers()) > 1:
                        logger.info("gossip joined through %d of %d bootstrap peers", reached,
                                    len(bootstrap))
                        break
                    await trio.sleep(delay_s)
                    delay_s = min(2 * delay_s, config.discovery.retry_max_s)
                try:
                    await trio.sleep_forever()
                finally:
                    with trio.move_on_after(2.0) as scope:
                        scope.shield = True
                        await service.leave()

        def status() -> dict | None:
            service = holder.get("service")
            return None if service is None else service.status()

        async def emulate(args: dict) -> dict:
            if shaper is None:
                raise ControlCommandError("this peer emulates no links: start it with --emulate")
            if args.get("heal") is True:
                shaper.heal()
            cut = args.get("cut", [])
            if not isinstance(cut, list) or len(cut) > MAX_CUT_PEERS:
                raise ControlCommandError("cut must be a list of peer ids (hex)")
            for ref in cut:
                try:
                    shaper.cut(peer_id=bytes.fromhex(ref))
                except (TypeError, ValueError):
                    raise ControlCommandError(f"bad peer id {ref!r}: give 64 hex digits") from None
            return {"cut_peers": sorted(p.hex() for p in shaper.cut_peers)}

        def training_status() -> dict | None:
            plane = holder.get("plane")
            return None if plane is None else plane.status()

        def plane() -> ControlPlane:
            found = holder.get("plane")
            if found is None:
                raise ControlCommandError("the control plane is not running yet")
            return found

        async def train_start(args: dict) -> dict:
            try:
                return await plane().start_training(TrainRequest.from_args(args), args=args)
            except TrainError as e:
                raise ControlCommandError(str(e)) from None

        async def train_reschedule(args: dict) -> dict:
            try:
                return await plane().reschedule()
            except TrainError as e:
                raise ControlCommandError(str(e)) from None

        async def train_stop(args: dict) -> dict:
            try:
                return await plane().stop_training()
            except TrainError as e:
                raise ControlCommandError(str(e)) from None

        daemon.add_service(run_gossip, name="gossip")
        daemon.add_status_provider("gossip", status)
        daemon.add_status_provider("training", training_status)
        daemon.add_control_op("emulate", emulate)
        daemon.add_control_op("train_start", train_start)
        daemon.add_control_op("train_stop", train_stop)
        daemon.add_control_op("train_reschedule", train_reschedule)

    return setup


def _advertised(daemon) -> tuple[str, int]:
    """The member address gossip starts with: the advertised one, or ("", 0), which nobody
    dials, while a peer on a wildcard waits for its peers to confirm one."""
    address = daemon.discovery.advertised
    return ("", 0) if address is None else (address.host, address.port)
