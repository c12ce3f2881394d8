"""What the daemon runs besides discovery: gossip membership and measurement, link emulation,
and the control plane that trains (the coordinator election, allocations, the stage worker,
reconfiguration; docs/control.md).

`build_shaper` makes the transport's LinkShaper from the [emulation] settings (before the
transport exists). `services_setup` returns the setup hook that adds two services to the
daemon: `GossipPart` runs a GossipService with the [gossip] settings (its reports carry this
peer's compute speed, [gossip] compute_ms, and coding speed, [gossip] codec_speed
(`codec_speed_setting`): each given, or measured once by a child process that imports torch
and exits, and kept in the data dir for the next start (peer/speed.py), so the daemon itself
never loads torch until it builds a stage), shows it under "gossip"
in `dtfm-peer status` and answers the `emulate` control op (`dtfm-swarm partition` / `heal`);
`PlanePart` runs the ControlPlane with the [plane] settings on that gossip service, shows it
under "training" and answers `train_info` (what an operator signs against), and `train_start`,
`train_stop`, `train_reschedule` and `train_resume`, each carrying an operator's signed operation (the plane
checks it against the operators the swarm key file names), and `train_status` (the run's
progress, from its coordinator); with `--metrics-listen`,
`MetricsPart` (peer/metrics.py) serves the daemon's status as Prometheus metrics. The sections
hold the lower layers' own configs (EmulationConfig, GossipConfig, PlaneConfig), passed on as
they are.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from dtfm.control import ControlPlane, SignedOp, TrainError, council_arg
from dtfm.gossip import GossipConfig, GossipService, compute_speed_ms, host_fingerprint
from dtfm.net import EmulatedLinks, ProtocolError, load_swarm_operators, short_id
from dtfm.scenarios import ScenarioError, load_scenario
from dtfm.sched import load_codec_speed

from .config import MAX_CLOCK_JUMP_S, ConfigError, DaemonConfig
from .daemon import Daemon
from .control_client import DEPOSED, ControlCommandError
from .speed import KIND_FILE, SPEED_FILE, KindCache, SelfSpeed, SpeedCache, speed_key

logger = logging.getLogger(__name__)

MAX_CUT_PEERS = 4096


def build_shaper(config: DaemonConfig) -> EmulatedLinks | None:
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


def measure_codec_ns(torch_threads: int, device: str = "cpu") -> tuple[float, ...]:
    """This peer's coding speed as gossip carries it, measured where its stage codes (`device`,
    the daemon's --device: a GPU stage encodes and decodes on its GPU). Blocking; torch is
    imported here: the daemon runs it in a child process (`self_speed`), never in itself."""
    from dtfm.train import peer_codec_speed

    return peer_codec_speed(torch_threads, device).to_vector()


def layer_probe_setting(config: DaemonConfig, root: Path) -> KindCache | None:
    """The probe of a run's layer and of this machine that this daemon's planner uses, per the
    [gossip] layer_probe setting: its figures kept in the data dir at `root` or the kinds_file
    setting's file (measure), or none
    (off: every layer at the reference rate, the reported compute figures as they are)."""
    if config.gossip.layer_probe == "off":
        return None
    path = Path(config.gossip.kinds_file) if config.gossip.kinds_file else root / KIND_FILE
    return KindCache(path, speed_key(config.plane.device, config.plane.settings.torch_threads))


def codec_speed_setting(config: DaemonConfig) -> tuple[tuple[float, ...] | None, Callable[[], Sequence[float]] | None]:
    """(the coding speed to report, or None; the probe that measures it, or None) for the
    [gossip] codec_speed setting. ConfigError for a file that is not a codec speed."""
    value = config.gossip.codec_speed
    if value == "measure":
        return None, functools.partial(measure_codec_ns, config.plane.settings.torch_threads, config.plane.device)
    try:
        return load_codec_speed(value).to_vector(), None
    except OSError as e:
        raise ConfigError(f"gossip.codec_speed (--codec-speed) {value}: cannot read it: {e.strerror}; "
                          "give measure, reference, free or a JSON file") from None
    except ValueError as e:
        raise ConfigError(f"gossip.codec_speed (--codec-speed) {value}: not a codec speed JSON object "
                          f"(as `bench/compress_sched.py --codec-speed-out` writes): {e}") from None


def self_speed(config: DaemonConfig, data_dir: Path, *, compute: bool, codec: bool) -> SelfSpeed | None:
    """The figures this peer measures (`compute`, `codec`: which), from the data dir's cache
    or, once, a child process (peer/speed.py); None when both are given in the settings."""
    if not (compute or codec):
        return None
    plane = config.plane
    key = speed_key(plane.device, plane.settings.torch_threads)
    return SelfSpeed(SpeedCache(data_dir / SPEED_FILE, key), compute=compute, codec=codec)


def gossip_config(config: DaemonConfig) -> GossipConfig:
    """The [gossip] settings, max_sync_bytes capped so a sync message fits in one control
    frame of the transport."""
    settings = config.gossip.settings
    limit = config.transport.max_control_frame_bytes // 2
    return settings.with_(max_sync_bytes=limit) if settings.max_sync_bytes > limit else settings


def services_setup(config: DaemonConfig, shaper: EmulatedLinks | None = None) -> Callable[[Daemon], None]:
    """A setup hook for run_daemon: gossip, then the control plane on it, run as daemon
    services. Gossip joins through the bootstrap peers only once the plane has started, so the
    plane's handlers and member-change hook are in place before the swarm can reach it."""

    def setup(daemon: Daemon) -> None:
        gossip = GossipPart(config, shaper)
        plane = PlanePart(config, gossip)
        daemon.add_service(gossip.run, name="gossip")
        daemon.add_service(plane.run, name="plane")
        daemon.add_service(gossip.join_bootstrap, name="gossip-bootstrap")
        daemon.add_status_provider("gossip", gossip.status)
        daemon.add_status_provider("training", plane.status)
        daemon.add_control_op("emulate", gossip.emulate)
        daemon.add_leave_hook(plane.hand_off, name="plane hand-off")  # first: the run goes on without this peer
        daemon.add_leave_hook(gossip.leave, name="gossip leave")  # then gossip says "left", not "dead"
        for op, handler in plane.control_ops().items():
            daemon.add_control_op(op, handler)
        if config.metrics.listen is not None:
            from .metrics import MetricsPart  # prometheus_client: only a daemon that serves metrics loads it

            metrics = MetricsPart(config.metrics)
            daemon.add_service(metrics.run, name="metrics")
            daemon.add_status_provider("metrics", metrics.status)

    return setup


class GossipPart:
    """The daemon's gossip service and the `emulate` op on its link emulator."""

    def __init__(self, config: DaemonConfig, shaper: EmulatedLinks | None = None):
        self.config = config
        self.shaper = shaper
        self.service: GossipService | None = None  # once `run` has started it
        self._left = False
        self.clock_jump_s = 0.0  # an emulated jump of this peer's wall clock (the `emulate` op): gossip's signed times
        self.codec_ns, self.codec_probe = codec_speed_setting(config)  # (ConfigError here, before the daemon starts)

    async def run(self, daemon: Daemon, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        compute_ms, codec_ns = config.gossip.compute_ms or None, self.codec_ns
        speed = self_speed(config, daemon.data_dir.root, compute=compute_ms is None,
                           codec=codec_ns is None and self.codec_probe is not None)
        if speed is not None:
            compute_ms = compute_ms or speed.figures.compute_ms
            codec_ns = codec_ns or speed.figures.codec_ns
            logger.info("this peer's speed figures: %s (%s)", "measured by a child process" if speed.missing()
                        else "as measured before", speed.cache.path)
        service = GossipService(daemon.transport, daemon.identity, gossip_config(config),
                                region=config.peer.region, compute_ms=compute_ms,
                                address=_advertised(daemon), codec_ns=codec_ns,
                                codec_probe=speed.codec_ns if speed is not None and codec_ns is None else None,
                                compute_probe=speed.compute_ms if speed is not None else compute_speed_ms,
                                wall_clock=lambda: time.time() + self.clock_jump_s, machine=host_fingerprint())
        daemon.discovery.on_advertise(lambda a: service.set_address(a.host, a.port))
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            self.service = service
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                if speed is not None:
                    speed.close()  # (a child still measuring would hold the leave up for its seconds)
                if not self._left:  # (the daemon's leave hook announced it while the transport was up)
                    with trio.move_on_after(2.0) as scope:
                        scope.shield = True
                        await service.leave()

    async def leave(self) -> None:
        """Announce this peer's leave (gossip's LEFT, signed by this peer) and let it spread."""
        if self.service is not None and not self._left:
            self._left = True
            with trio.move_on_after(2.0):
                await self.service.leave()

    async def join_bootstrap(self, daemon: Daemon, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join the swarm through the bootstrap peers. They may still be starting: retry with
        backoff until one answers or gossip has found the swarm some other way."""
        service = self.service
        if service is None:
            raise RuntimeError("the gossip service must start before its bootstrap join")
        task_status.started()
        config = self.config
        bootstrap = [(a.host, a.port) for a in config.peer.bootstrap if a != daemon.listen_address]
        delay_s = config.discovery.retry_initial_s
        while bootstrap:
            reached = await service.join(bootstrap)
            if reached or len(service.live_peers()) > 1:
                logger.info("gossip joined through %d of %d bootstrap peers", reached, len(bootstrap))
                break
            await trio.sleep(delay_s)
            delay_s = min(2 * delay_s, config.discovery.retry_max_s)

    def status(self) -> dict | None:
        return None if self.service is None else self.service.status()

    async def emulate(self, args: dict) -> dict:
        shaper = self.shaper
        if shaper is None:
            raise ControlCommandError("this peer emulates no links: start it with --emulate")
        if args.get("heal") is True:
            shaper.heal()
        jump = args.get("clock_jump_s")
        if jump is not None:  # this peer's wall clock jumps (NTP stepping it, a VM resumed): its signed times
            if type(jump) not in (int, float) or not abs(jump) <= MAX_CLOCK_JUMP_S:
                raise ControlCommandError(f"clock_jump_s must be a number of seconds within +-{MAX_CLOCK_JUMP_S:g}")
            self.clock_jump_s = float(jump)
        cut = args.get("cut", [])
        if not isinstance(cut, list) or len(cut) > MAX_CUT_PEERS:
            raise ControlCommandError("cut must be a list of peer ids (hex)")
        for ref in cut:
            try:
                shaper.cut(peer_id=bytes.fromhex(ref))
            except (TypeError, ValueError):
                raise ControlCommandError(f"bad peer id {ref!r}: give 64 hex digits") from None
        return {"cut_peers": sorted(p.hex() for p in shaper.cut_peers), "clock_jump_s": self.clock_jump_s}


class PlanePart:
    """The daemon's control plane, on the gossip service of `gossip`, and the train ops."""

    def __init__(self, config: DaemonConfig, gossip: GossipPart):
        self.config = config
        self.gossip = gossip
        self.plane: ControlPlane | None = None  # once `run` has started it

    async def run(self, daemon: Daemon, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        service = self.gossip.service
        if service is None:
            raise RuntimeError("the gossip service must start before the control plane")
        operators = self.operators()
        if operators:
            logger.info("operators of this swarm: %s", ", ".join(short_id(p) for p in operators))
        else:
            logger.warning("the swarm key file names no operator: no run can be started, stopped or rescheduled "
                           "(make a swarm key with `dtfm-peer swarm-key new --out FILE`, which adds one)")
        kinds = layer_probe_setting(self.config, daemon.data_dir.root)
        plane = ControlPlane(daemon.transport, daemon.identity, service, daemon.data_dir.root,
                             self.config.plane.settings, operators=operators, kind_probe=kinds,
                             fresh_compute=kinds.machine_now if kinds is not None else None,
                             machine=service.machine)
        service.keep_members(lambda peer_id: named_by(plane, peer_id))
        async with trio.open_nursery() as nursery:
            await nursery.start(plane.run)
            self.plane = plane
            task_status.started()

    def status(self) -> dict | None:
        return None if self.plane is None else self.plane.status()

    async def hand_off(self) -> None:
        """Before a planned leave: the coordinator reconfigures the run without this peer (at a
        step boundary, its stages offered from memory); bounded by the plane's leave_hand_off_s."""
        if self.plane is None:
            return
        why = await self.plane.operator.hand_off()
        if why is None:
            logger.info("this peer's part in the run is handed off: leaving")
        else:
            logger.warning("leaving without a hand-off (%s): the run will treat this peer as failed and "
                           "reconfigure without it, from the last step every stage holds", why)

    def operators(self) -> tuple[bytes, ...]:
        """The operators' public keys the swarm key file names."""
        path = self.config.peer.swarm_key_file
        return load_swarm_operators(path) if path is not None else ()

    def control_ops(self) -> dict[str, Callable[[dict], Awaitable[Any]]]:
        return {"train_info": self.train_info, "train_start": self.train_start, "train_stop": self.train_stop,
                "train_reschedule": self.train_reschedule, "train_resume": self.train_resume,
                "train_council": self.train_council, "council_proposal": self.council_proposal,
                "export": self.export,
                "export_progress": self.export_progress,
                "train_status": self.train_status}

    def _running(self) -> ControlPlane:
        if self.plane is None:
            raise ControlCommandError("the control plane is not running yet")
        return self.plane

    async def train_info(self, args: dict) -> dict:
        """What `dtfm-peer train` signs against: the swarm's operators, the run in progress, this
        peer's data set, and the swarm key file (the operator key is kept beside it)."""
        wait_peers, wait_s = args.get("wait_peers", 0), args.get("wait_s", 0.0)
        if type(wait_peers) is not int or not 0 <= wait_peers <= 1 << 16 \
                or type(wait_s) not in (int, float) or not 0 <= wait_s <= 86400:
            raise ControlCommandError("train_info: wait_peers is a count and wait_s seconds (at most a day)")
        try:
            info = await self._running().operator.operator_info(wait_peers=wait_peers, wait_s=float(wait_s))
        except TrainError as e:
            raise ControlCommandError(str(e)) from None
        path = self.config.peer.swarm_key_file
        return {**info, "swarm_key_file": str(path.absolute()) if path is not None else None}

    async def train_start(self, args: dict) -> dict:
        try:
            return await self._running().operator.start_training(_signed(args))
        except TrainError as e:
            raise ControlCommandError(str(e), code=DEPOSED if e.deposed else None) from None

    async def train_reschedule(self, args: dict) -> dict:
        try:
            return await self._running().operator.reschedule(_signed(args))
        except TrainError as e:
            raise ControlCommandError(str(e)) from None

    async def council_proposal(self, args: dict) -> dict:
        """The council this daemon would name of its live, measured peers (`train council`)."""
        return {"council": council_arg(self._running().operator.propose_council())}

    async def train_council(self, args: dict) -> dict:
        try:
            return await self._running().operator.reroot(_signed(args))
        except TrainError as e:
            raise ControlCommandError(str(e)) from None

    async def train_resume(self, args: dict) -> dict:
        try:
            return await self._running().operator.resume_training(_signed(args))
        except TrainError as e:
            raise ControlCommandError(str(e)) from None

    async def export(self, args: dict) -> dict:
        """`dtfm-peer export`: the operator's signed export naming this peer, and the folder to
        write (an absolute path on this machine: the socket is the local user's)."""
        out = args.get("out") if isinstance(args, dict) else None
        if not isinstance(out, str) or not Path(out).is_absolute():
            raise ControlCommandError("export needs the absolute path of the folder to write (out)")
        try:
            return await self._running().operator.export(_signed(args), Path(out),
                                                         overwrite=args.get("overwrite") is True)
        except TrainError as e:
            raise ControlCommandError(str(e)) from None

    async def export_progress(self, args: dict) -> dict:
        progress = self._running().operator.export_progress
        return progress.to_wire() if progress is not None else {}

    async def train_status(self, args: dict) -> dict:
        """The run's progress from its coordinator (control/progress.py): `run` (hex, optional)
        and `after` (the last step the reader has seen, -1: none)."""
        run, after = args.get("run"), args.get("after", -1)
        if run is not None and (not isinstance(run, str) or len(run) != 32):
            raise ControlCommandError("RUN must be a run id: 32 hex digits (`dtfm-peer status` shows it)")
        try:
            run_id = None if run is None else bytes.fromhex(run)
        except ValueError:
            raise ControlCommandError(f"RUN must be a run id of 32 hex digits, got {run!r}") from None
        if type(after) is not int or after < -1:
            raise ControlCommandError("after must be a step number (or -1)")
        try:
            progress = await self._running().operator.train_progress(run_id, after)
        except TrainError as e:
            raise ControlCommandError(str(e)) from None
        wire = progress.to_wire()
        return {**wire, "run": progress.run_id.hex(), "coordinator": progress.coordinator.hex()}

    async def train_stop(self, args: dict) -> dict:
        try:
            return await self._running().operator.stop_training(_signed(args))
        except TrainError as e:
            raise ControlCommandError(str(e)) from None


def named_by(plane: ControlPlane, peer_id: bytes) -> bool:
    """Whether the allocation this peer applied names peer_id (at a stage or as a spare), or
    peer_id votes in the election: gossip never removes such a member to make room."""
    cur = plane.epoch.current
    if cur is not None and (peer_id in cur.peers or peer_id in cur.spares):
        return True
    return peer_id in plane.election.voters


def _signed(args: dict) -> SignedOp:
    """The operator's signed operation a train op carries."""
    if not isinstance(args, dict) or "op" not in args:
        raise ControlCommandError("a train operation must carry the operator's signed operation: use "
                                  "`dtfm-peer train` of the same dtfm version as the daemon")
    try:
        return SignedOp.from_wire(args["op"])
    except ProtocolError as e:
        raise ControlCommandError(f"the operator's signed operation is malformed: {e}") from None


def _advertised(daemon: Daemon) -> tuple[str, int]:
    """The member address gossip starts with: the advertised one, or ("", 0), which nobody
    dials, while a peer on a wildcard waits for its peers to confirm one."""
    address = daemon.discovery.advertised
    return ("", 0) if address is None else (address.host, address.port)
