"""Daemon configuration: one frozen dataclass per concern, each a TOML table of the same name
(`[peer]`, `[discovery]`, ...), merged from defaults, a TOML file and command-line flags (flags
win; reading them is dtfm.peer.settings).

A field declared with `option(..., flag="--name")` is also a `dtfm-peer join` flag; the flag's
help and default come from the field, so they cannot drift. Adding a setting is adding one
field. The tables of lower layers are their own config dataclasses: [transport] is
dtfm.net.TransportConfig, [gossip] embeds dtfm.gossip.GossipConfig, [emulation]
dtfm.net.EmulationConfig and [plane] dtfm.control.PlaneConfig, with those classes' names,
defaults, checks and profiles.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from dtfm.control import DEVICE_RE, ElectionConfig, PlaneConfig
from dtfm.gossip import GossipConfig
from dtfm.net import Address, EmulationConfig, TransportConfig

REGION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_BOOTSTRAP = 64
MAX_CLOCK_JUMP_S = 86400.0 * 365  # an emulated wall-clock jump (the `emulate` op), either way


class ConfigError(ValueError):
    """A bad setting; str() names the setting and what is wrong with it."""


class ListenError(Exception):
    """The daemon could not listen on its address; str() says which and why."""


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The TOML table of the file at `path`; ConfigError names `what` it is and the file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid TOML: {e}") from None


def option(default: Any, help: str, *, flag: str | None = None, metavar: str | None = None,
           repeat: bool = False) -> Any:
    """A config field; with `flag` it is also a command-line option of `dtfm-peer join`.

    `repeat=True` makes a tuple-valued flag that may be given several times.
    """
    meta = {"help": help, "flag": flag, "metavar": metavar, "repeat": repeat}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple default")
    return field(default=default, metadata=meta)


def _positive(section: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{section}.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class PeerConfig:
    """Who this peer is and where it listens. TOML table [peer]."""

    data_dir: Path | None = option(
        None, "data directory: identity key, control socket (default: $DTFM_DATA_DIR, else "
        "$XDG_DATA_HOME/dtfm or ~/.local/share/dtfm)", flag="--data-dir", metavar="DIR")
    listen: Address = option(
        Address("0.0.0.0", 7450), "address to accept peers on; port 0 picks a free port",
        flag="--listen", metavar="HOST:PORT")
    bootstrap: tuple[Address, ...] = option(
        (), "a peer to join the swarm through; repeat for several", flag="--bootstrap",
        metavar="HOST:PORT", repeat=True)
    swarm_key_file: Path | None = option(
        None, "file with the swarm key (`dtfm-peer swarm-key new`); required to join",
        flag="--swarm-key", metavar="FILE")
    region: str = option(
        "", "region label shown to peers and used for scheduling, e.g. us-west",
        flag="--region", metavar="NAME")
    # Behind NAT or with several interfaces, the address peers must dial. Unset, a peer that
    # listens on a wildcard advertises the address its peers see it at, once one of them has
    # dialled it back there; port 0 means the listen port.
    advertise: Address | None = option(
        None, "address other peers dial to reach this one (default: the listen address, or "
        "for 0.0.0.0 / :: the address peers see and confirm by dialling back)",
        flag="--advertise", metavar="HOST:PORT")

    def __post_init__(self) -> None:
        if self.advertise is not None and self.advertise.is_unspecified:
            raise ConfigError(f"peer.advertise {self.advertise}: give an address peers can "
                              f"dial, not a wildcard")
        if self.region and not REGION_RE.match(self.region):
            raise ConfigError(f"peer.region {self.region!r}: use 1-64 letters, digits, '.', "
                              f"'_' or '-'")
        if len(self.bootstrap) > MAX_BOOTSTRAP:
            raise ConfigError(f"peer.bootstrap: at most {MAX_BOOTSTRAP} addresses")


@dataclass(frozen=True)
class DiscoveryConfig:
    """Finding peers: bootstrap dialling and peer-address exchange. TOML table [discovery]."""

    # Shorter first retry joins faster when peers start together; longer max backs off harder
    # from a bootstrap peer that is down.
    retry_initial_s: float = option(0.5, "first delay before redialling a failed bootstrap")
    retry_max_s: float = option(30.0, "longest delay between redials")
    # A dial that hangs this long is given up (firewalls that drop SYNs).
    connect_timeout_s: float = option(10.0, "give up on one dial after this long")
    # Lower finds new peers sooner at the cost of one small request per interval.
    exchange_interval_s: float = option(
        5.0, "how often to swap known peer addresses with one connected peer")
    exchange_max_peers: int = option(64, "most addresses sent in one exchange")
    exchange_timeout_s: float = option(5.0, "wait this long for a peer's address list")
    # How long `leave` waits for peers to hear the goodbye before closing connections.
    leave_timeout_s: float = option(2.0, "time allowed for telling peers we are leaving")
    departed_keep: int = option(32, "how many departed peers `status` remembers")
    # The peer book holds connected peers plus addresses heard from others; only the latter
    # are capped. Larger remembers more of a big swarm; smaller bounds what a liar can plant.
    max_known_peers: int = option(1024, "most addresses learnt from others kept at once")
    # One member's lies cannot fill the book: its own oldest unverified entries make room.
    max_peers_per_source: int = option(128, "most unverified addresses kept from one peer")
    # Dials in flight at once (learnt peers, bootstrap redials, address confirmations); the
    # rest wait in the peer book.
    max_concurrent_dials: int = option(8, "most dials in flight at once")
    # Exchanges from one peer beyond this rate are answered but what they carry is ignored.
    exchange_rate_per_s: float = option(1.0, "address lists accepted per second from one peer")
    exchange_burst: int = option(4, "address lists accepted at once from one peer")
    # A peer asked "what address do you see me at" dials back first: allow a full dial.
    address_query_timeout_s: float = option(
        15.0, "wait this long for a peer to confirm the address it sees this peer at")

    def __post_init__(self) -> None:
        for name in ("retry_initial_s", "retry_max_s", "connect_timeout_s",
                     "exchange_interval_s", "exchange_timeout_s", "leave_timeout_s",
                     "exchange_rate_per_s", "address_query_timeout_s"):
            _positive("discovery", name, getattr(self, name))
        if not 1 <= self.max_known_peers <= 1_000_000:
            raise ConfigError("discovery.max_known_peers must be in 1..1000000")
        if not 1 <= self.max_peers_per_source <= self.max_known_peers:
            raise ConfigError("discovery.max_peers_per_source must be in 1..max_known_peers")
        if not 1 <= self.max_concurrent_dials <= 1024:
            raise ConfigError("discovery.max_concurrent_dials must be in 1..1024")
        if not 1 <= self.exchange_burst <= 1024:
            raise ConfigError("discovery.exchange_burst must be in 1..1024")
        if self.retry_max_s < self.retry_initial_s:
            raise ConfigError("discovery.retry_max_s must be >= discovery.retry_initial_s")
        if not 1 <= self.exchange_max_peers <= 1024:
            raise ConfigError("discovery.exchange_max_peers must be in 1..1024")
        if not 0 <= self.departed_keep <= 1024:
            raise ConfigError("discovery.departed_keep must be in 0..1024")


@dataclass(frozen=True)
class SocketConfig:
    """The local control socket (`dtfm-peer status`, `leave`, `train`). TOML table [socket]."""

    max_request_bytes: int = option(64 * 1024, "largest request frame the daemon accepts")
    # Status grows with the swarm and with what services add; 4 MiB holds thousands of peers.
    max_response_bytes: int = option(4 * 1024 * 1024, "largest reply frame a client accepts")
    request_timeout_s: float = option(10.0, "a client gives up on a silent daemon after this")
    # Each holds a task and a buffer; a client over the limit is refused with "busy".
    max_clients: int = option(16, "concurrent control connections; more are refused")
    # A client that sends nothing for this long is dropped, freeing its slot.
    idle_timeout_s: float = option(60.0, "close a control connection that is silent this long")
    # `train start` waits for every peer to accept (the client's --timeout, 300 s by default):
    # an op running longer than this is cancelled and answered with an error.
    handler_timeout_s: float = option(900.0, "longest time one control op may run")

    def __post_init__(self) -> None:
        if not 1024 <= self.max_request_bytes <= 16 * 1024 * 1024:
            raise ConfigError("socket.max_request_bytes must be in 1 KiB..16 MiB")
        if not 1024 <= self.max_response_bytes <= 256 * 1024 * 1024:
            raise ConfigError("socket.max_response_bytes must be in 1 KiB..256 MiB")
        _positive("socket", "request_timeout_s", self.request_timeout_s)
        _positive("socket", "idle_timeout_s", self.idle_timeout_s)
        _positive("socket", "handler_timeout_s", self.handler_timeout_s)
        if not 1 <= self.max_clients <= 1024:
            raise ConfigError("socket.max_clients must be in 1..1024")


@dataclass(frozen=True)
class LogConfig:
    """Logging. TOML table [log]."""

    level: str = option("info", "log level: debug, info, warning or error", flag="--log-level",
                        metavar="LEVEL")
    json: bool = option(False, "log JSON lines instead of human-readable lines",
                        flag="--log-json")
    # Unset: stderr, for a supervisor (systemd's journal) to keep and rotate. A file is rotated
    # by the daemon itself: past max_mb it becomes FILE.1 (FILE.1 becomes FILE.2, ...) and the
    # oldest of `backups` is deleted, so the logs take at most (backups + 1) x max_mb.
    file: Path | None = option(None, "write the log to this file, rotated by size (default: stderr)",
                               flag="--log-file", metavar="PATH")
    max_mb: float = option(32.0, "size in MiB past which the log file is rotated", flag="--log-max-mb",
                           metavar="MB")
    backups: int = option(3, "rotated log files kept (FILE.1 ... FILE.N)", flag="--log-backups", metavar="N")

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise ConfigError(f"log.level {self.level!r}: choose one of {', '.join(LOG_LEVELS)}")
        if not (math.isfinite(self.max_mb) and self.max_mb > 0) or self.backups < 0:
            raise ConfigError("log.max_mb must be a positive number and log.backups >= 0")


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint (docs/daemon.md, "Metrics"). TOML table [metrics]."""

    # Unset: no endpoint. It serves whoever can reach it (no authentication, as is usual for
    # /metrics): bind it to loopback or a monitoring network, not to the internet.
    listen: Address | None = option(
        None, "serve Prometheus metrics at http://HOST:PORT/metrics (default: off)",
        flag="--metrics-listen", metavar="HOST:PORT")
    # A scraper sends a short GET: longer requests, and slower ones, are cut off.
    max_request_bytes: int = option(8192, "longest HTTP request head accepted")
    request_timeout_s: float = option(5.0, "time allowed to send the request and read the answer")
    # Scrapes at once; more are closed at once rather than queued.
    max_connections: int = option(16, "most scrapes served at once")

    def __post_init__(self) -> None:
        if self.max_request_bytes < 64 or self.max_connections < 1:
            raise ConfigError("metrics.max_request_bytes must be >= 64 and metrics.max_connections >= 1")
        _positive("metrics", "request_timeout_s", self.request_timeout_s)


def _profiles(cls: type) -> tuple[str, ...]:
    """The named profiles of a config class: its classmethods that take no argument and return
    an instance (GossipConfig.lan, .wan, ...), in the order the class defines them."""
    names = []
    for name, attr in vars(cls).items():
        if not isinstance(attr, classmethod):
            continue
        method = getattr(cls, name)
        if not inspect.signature(method).parameters and typing.get_type_hints(method).get("return") is cls:
            names.append(name)
    return tuple(names)


GOSSIP_PROFILES = _profiles(GossipConfig)
PLANE_PROFILES = _profiles(PlaneConfig)
ELECTION_PROFILES = _profiles(ElectionConfig)


def _one_of(names: tuple[str, ...]) -> str:
    """'a, b or c'."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


def lower_layer_error(section: str, keys: list[str], error: ValueError) -> ConfigError:
    """A lower layer's refusal of settings as a ConfigError naming the keys of `section` it is
    about: those of `keys` its message mentions, else all of `keys`."""
    text = str(error)
    # A nested config's message names its own field: "lease_s" for the key "election.lease_s".
    named = [k for k in keys if re.search(rf"\b{re.escape(k.rpartition('.')[2])}\b", text)] or keys
    return ConfigError(f"{', '.join(f'{section}.{k}' for k in named)}: {text}")


# A section that embeds the config dataclass of the layer it drives says so with EMBEDDED:
# every field of that class is a key of the section's table (its name, type, default and checks
# are the lower layer's), `settings` is the resulting config and `with_settings(**changes)`
# applies keys. EMBEDDED_FLAGS names the keys that are also `join` flags. A field that is
# itself a config dataclass (PlaneConfig's election) gives a key per field of it, "outer.NAME",
# which TOML writes as a dotted key or a sub-table ([plane.election]).
# EMBEDDED_SET_BY_SECTION names fields that are no keys because the section sets them.

@dataclass(frozen=True)
class Flag:
    """A `dtfm-peer join` flag for one key of an embedded config."""

    key: str
    flag: str
    help: str
    metavar: str | None = None


@dataclass(frozen=True)
class GossipSection:
    """Membership, failure detection and network measurement. TOML table [gossip]: a named
    profile of dtfm.gossip.GossipConfig, any of its fields set over the profile, and this
    peer's compute and coding speeds."""

    EMBEDDED: ClassVar[type] = GossipConfig
    EMBEDDED_FLAGS: ClassVar[tuple[Flag, ...]] = ()

    # One of GossipConfig's named profiles: its timings for a data centre, slow links, one
    # machine or tests (see dtfm.gossip.config).
    profile: str = option("lan", f"gossip timing profile: {_one_of(GOSSIP_PROFILES)}",
                          flag="--gossip-profile", metavar="NAME")
    # 0 measures this peer's speed with a short torch workload, once, in a child process
    # whose figure the data dir keeps (peer/speed.py); a positive figure is reported as given.
    compute_ms: float = option(0.0, "this peer's time for one transformer-block forward and "
                               "backward in ms; 0 measures it", flag="--compute-ms", metavar="MS")
    # What coding (compression) costs on this CPU, gossiped for the scheduler's per-link
    # choice: "measure" probes it once, in the child process that measures compute_ms (its
    # figures kept in the data dir: peer/speed.py); "reference" reports the development
    # machine's figure, "free" zero cost, and a JSON file (as `dtfm-sched --codec-speed`
    # reads) its figures, all without the probe.
    codec_speed: str = option("measure", "this peer's coding speed for the scheduler: measure, reference, "
                              "free or a JSON file of ns per element", flag="--codec-speed",
                              metavar="measure|reference|free|FILE.json")
    # When this daemon places a run (as its coordinator): "measure" times the run's layer at
    # each micro-batch size the scheduler may choose and this machine's reference block now
    # (in a child process until this daemon trains, its figures kept in the data dir:
    # peer/speed.py `KindCache`); "off" costs every layer at the reference rate from the
    # peers' reported compute figures, with no probe (a test swarm whose runs fix their shapes).
    layer_probe: str = option("measure", "time the run's layer and this machine when this daemon places a "
                              "run: measure, or off (the peers' reported compute figures stand)",
                              flag="--layer-probe", metavar="measure|off")
    # Where the layer probe keeps its figures: the data dir's kinds.json when empty. Daemons of
    # one machine may share one file (dtfm-swarm's peers do): the coordinator's probe at a run's
    # start then spares every training peer its own probe beside its first steps.
    kinds_file: str = option("", "the layer probe's figures file (default: kinds.json in the data dir); "
                             "daemons of one machine may share one", flag="--kinds-file", metavar="FILE")
    # GossipConfig fields set in [gossip], as sorted (name, value) pairs; they win over the
    # profile's values whichever layer (file or flag) chose the profile.
    overrides: tuple[tuple[str, int | float], ...] = ()

    def __post_init__(self) -> None:
        if self.profile not in GOSSIP_PROFILES:
            raise ConfigError(f"gossip.profile {self.profile!r}: choose one of "
                              f"{', '.join(GOSSIP_PROFILES)}")
        if not (math.isfinite(self.compute_ms) and self.compute_ms >= 0):
            raise ConfigError("gossip.compute_ms must be a non-negative number")
        if self.layer_probe not in ("measure", "off"):
            raise ConfigError(f"gossip.layer_probe {self.layer_probe!r}: choose measure or off")
        if not self.codec_speed:
            raise ConfigError("gossip.codec_speed must be measure, reference, free or a JSON file's path")
        try:
            self._resolve()
        except ValueError as e:
            raise lower_layer_error("gossip", [k for k, _ in self.overrides], e) from None

    def _resolve(self) -> GossipConfig:
        return dataclasses.replace(getattr(GossipConfig, self.profile)(), **dict(self.overrides))

    @property
    def settings(self) -> GossipConfig:
        """The profile with the overrides applied."""
        return self._resolve()

    def with_settings(self, **changes: Any) -> GossipSection:
        merged = {**dict(self.overrides), **changes}
        return dataclasses.replace(self, overrides=tuple(sorted(merged.items())))


@dataclass(frozen=True)
class EmulationSection:
    """Link emulation for test swarms on one machine. TOML table [emulation]: the scenario to
    emulate and any field of dtfm.net.EmulationConfig."""

    EMBEDDED: ClassVar[type] = EmulationConfig
    EMBEDDED_FLAGS: ClassVar[tuple[Flag, ...]] = (
        # > 1 slows the whole emulated network uniformly (delays x, bandwidth /), so a small
        # model sees the communication-to-compute ratio of a large one.
        Flag("time_scale", "--time-scale", "multiply emulated delays and divide emulated "
             "bandwidth by this", "X"),
        # Loopback and Python crypto carry a few Gbps in all: scale the scenario's links down.
        Flag("bandwidth_scale", "--bandwidth-scale", "multiply every emulated bandwidth by this",
             "X"),
        Flag("drop_fraction", "--drop", "fraction of droppable frames (gossip datagrams) lost",
             "FRACTION"),
    )

    scenario: str = option(
        "", "emulate the links of this scenario (built-in name or TOML file) for every frame "
        "this peer sends; its --region must be one of the scenario's regions",
        flag="--emulate", metavar="SCENARIO")
    settings: EmulationConfig = EmulationConfig()

    def with_settings(self, **changes: Any) -> EmulationSection:
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, **changes))


@dataclass(frozen=True)
class PlaneSection:
    """The control plane: the coordinator election, allocations, reconfiguration, and the stage
    this peer trains. TOML table [plane]: a named profile of dtfm.control.PlaneConfig (and
    optionally another election profile), any of its fields set over the profile (those of its
    nested ElectionConfig and CommConfig as `election.NAME` and `comm.NAME`, or in tables
    [plane.election] and [plane.comm]), and the data this peer trains on."""

    EMBEDDED: ClassVar[type] = PlaneConfig
    EMBEDDED_FLAGS: ClassVar[tuple[Flag, ...]] = (
        # Several daemons on one machine want 1 each; a machine of its own wants its core count.
        Flag("torch_threads", "--torch-threads", "torch threads of the stage worker", "N"),
        # Each costs 12 bytes a parameter of this peer's stage; older ones are deleted.
        Flag("checkpoints_kept", "--keep-checkpoints", "checkpoints kept per stage of each run, the newest", "K"),
        # An older run's checkpoints are deleted when a newer run's land.
        Flag("runs_kept", "--keep-runs", "runs whose checkpoints stay on disk, the newest", "R"),
        # (what the coordinator hands out; the paper's GPipe for comparisons)
        Flag("pipeline_schedule", "--pipeline-schedule", "the stages' order of forwards and backwards when this "
             "peer coordinates: fitted (1F1B fitted to the links, or GPipe where that is as fast) or gpipe",
             "NAME"),
    )
    # PlaneConfig fields that are no keys: the section sets them from its own fields.
    EMBEDDED_SET_BY_SECTION: ClassVar[tuple[str, ...]] = ("data_path", "tokenizer_path", "model_paths", "device")

    # One of PlaneConfig's named profiles: its timings for a data centre, peers across
    # continents, or a test swarm on one machine (see dtfm.control.config).
    profile: str = option("wan", f"control plane timing profile: {_one_of(PLANE_PROFILES)}",
                          flag="--plane-profile", metavar="NAME")
    # One of ElectionConfig's named profiles instead of the plane profile's election (with the
    # waits that follow it): a test swarm that emulates worldwide links wants the test profile's
    # checks and the wan election, whose lease outlasts a worldwide round trip.
    election_profile: str = option("", "coordinator election timing profile: "
                                   f"{_one_of(ELECTION_PROFILES)} (default: the plane profile's)",
                                   flag="--election-profile", metavar="NAME")
    # Every peer of a run must hold the same content: the allocation carries its hash. Checked
    # here, so a daemon with a mistyped path does not start.
    data: Path | None = option(None, "the text file or folder of text files this peer trains on, or a "
                               "pre-tokenized token file (nanoGPT's train.bin: uint16, *.uint32.bin: uint32); "
                               "every peer of a run needs the same content (default: the Python "
                               "standard library's source)", flag="--data", metavar="PATH")
    # Text data is tokenized as bytes unless a folder's Hugging Face tokenizer is named; the
    # run's data hash is of the tokens, so every peer must tokenize alike.
    tokenizer: Path | None = option(None, "tokenize the text --data with this Hugging Face folder's tokenizer "
                                    "(tokenizer.json, or vocab.json and merges.txt) (default: bytes)",
                                    flag="--tokenizer", metavar="DIR")
    # Runs started with `train start --init-from` name their folder by digest; a peer holds it
    # here or refuses the run.
    model_dirs: tuple[Path, ...] = option((), "a Hugging Face GPT-2-family folder (config.json, "
                                          "model.safetensors) a run may start from (`train start --init-from`); "
                                          "every peer of such a run needs a copy; repeatable",
                                          flag="--model-dir", metavar="DIR", repeat=True)
    # Where the stage is built and trained; cuda needs a GPU torch sees (checked at `join`).
    device: str = option("cpu", "torch device of this peer's stage: cpu, cuda or cuda:N", flag="--device",
                         metavar="DEVICE")
    # PlaneConfig fields set in [plane], as sorted (name, value) pairs, nested ones as
    # "election.NAME" / "comm.NAME"; they win over the profile's values whichever layer (file
    # or flag) chose the profile.
    overrides: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.profile not in PLANE_PROFILES:
            raise ConfigError(f"plane.profile {self.profile!r}: choose one of "
                              f"{', '.join(PLANE_PROFILES)}")
        if self.election_profile and self.election_profile not in ELECTION_PROFILES:
            raise ConfigError(f"plane.election_profile {self.election_profile!r}: choose one of "
                              f"{', '.join(ELECTION_PROFILES)}")
        if self.data is not None and not self.data.exists():
            raise ConfigError(f"plane.data (--data) {self.data}: no such file or folder; give the text "
                              f"file or folder of text files this peer trains on")
        if self.data is not None and self.data.is_file() and self.data.stat().st_size == 0:
            raise ConfigError(f"plane.data (--data) {self.data}: the file is empty; give the text file or "
                              "folder of text files this peer trains on")
        if self.tokenizer is not None and not self.tokenizer.is_dir():
            raise ConfigError(f"plane.tokenizer (--tokenizer) {self.tokenizer}: no such folder; give a Hugging "
                              "Face model or tokenizer folder")
        if self.tokenizer is not None and self.data is not None and str(self.data).endswith(".bin"):
            raise ConfigError(f"plane.tokenizer (--tokenizer): --data {self.data} is a token file, already "
                              "tokenized: leave --tokenizer out")
        for d in self.model_dirs:
            if not (d / "config.json").is_file():
                raise ConfigError(f"plane.model_dirs (--model-dir) {d}: no config.json there; give a Hugging "
                                  "Face GPT-2-family folder (config.json, model.safetensors)")
        if not DEVICE_RE.fullmatch(self.device):
            raise ConfigError(f"plane.device (--device) {self.device!r}: choose cpu, cuda or cuda:N")
        try:
            self._resolve()
        except ValueError as e:
            raise lower_layer_error("plane", [k for k, _ in self.overrides], e) from None

    def _resolve(self) -> PlaneConfig:
        base = getattr(PlaneConfig, self.profile)()
        if self.election_profile:
            base = base.with_election(getattr(ElectionConfig, self.election_profile)())
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for key, value in self.overrides:
            outer, dot, inner = key.partition(".")
            if dot:
                nested.setdefault(outer, {})[inner] = value
            else:
                top[key] = value
        for outer, changes in nested.items():
            top[outer] = dataclasses.replace(getattr(base, outer), **changes)
        data = str(self.data) if self.data is not None else None
        tokenizer = str(self.tokenizer) if self.tokenizer is not None else None
        return dataclasses.replace(base, data_path=data, tokenizer_path=tokenizer,
                                   model_paths=tuple(str(d) for d in self.model_dirs), device=self.device, **top)

    @property
    def settings(self) -> PlaneConfig:
        """The profile with the overrides and the data path applied."""
        return self._resolve()

    def with_settings(self, **changes: Any) -> PlaneSection:
        merged = {**dict(self.overrides), **changes}
        return dataclasses.replace(self, overrides=tuple(sorted(merged.items())))


@dataclass(frozen=True)
class DaemonConfig:
    """Everything `dtfm-peer join` needs, one section per concern."""

    peer: PeerConfig = PeerConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    socket: SocketConfig = SocketConfig()
    log: LogConfig = LogConfig()
    # Frame limits, timeouts, key renewal, handshake admission: see dtfm.net.transport.
    transport: TransportConfig = TransportConfig()
    gossip: GossipSection = GossipSection()
    emulation: EmulationSection = EmulationSection()
    plane: PlaneSection = PlaneSection()
    metrics: MetricsConfig = MetricsConfig()

    def __post_init__(self) -> None:
        # The data plane's tensors in flight to a neighbour arrive as the transport's payloads and
        # handlers, which gossip and control share: a window past half of either would have the
        # transport close connections (too many payloads in flight) or refuse requests (busy).
        window = self.plane.settings.comm.window_messages
        room = min(self.transport.max_inflight_payloads, self.transport.max_concurrent_handlers) // 2
        if window > room:
            raise ConfigError(f"plane.comm.window_messages {window}: at most half of transport."
                              f"max_inflight_payloads ({self.transport.max_inflight_payloads}) and of "
                              f"transport.max_concurrent_handlers ({self.transport.max_concurrent_handlers}); "
                              f"lower it or raise those")

    @classmethod
    def default(cls) -> DaemonConfig:
        return cls()

    @classmethod
    def test(cls) -> DaemonConfig:
        """Loopback, port 0, fast retries and exchanges, the plane's test timings: for tests and
        local swarms."""
        return cls(
            peer=PeerConfig(listen=Address("127.0.0.1", 0)),
            discovery=DiscoveryConfig(retry_initial_s=0.05, retry_max_s=0.5,
                                      connect_timeout_s=2.0, exchange_interval_s=0.5,
                                      exchange_timeout_s=2.0, leave_timeout_s=1.0,
                                      exchange_rate_per_s=4.0, exchange_burst=8,
                                      address_query_timeout_s=5.0),
            socket=SocketConfig(request_timeout_s=5.0),
            transport=TransportConfig.test(),
            plane=PlaneSection(profile="test"),
        )
