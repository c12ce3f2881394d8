"""Daemon configuration: one frozen dataclass per concern, merged from defaults, a TOML file
and command-line flags (flags win).

Each section dataclass is a TOML table of the same name (`[peer]`, `[discovery]`, ...). A field
declared with `option(..., flag="--name")` is also a `dtfm-peer join` flag; the flag's help and
default come from the field, so they cannot drift. Adding a setting is adding one field.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtfm.net import Address, AddressError, TransportConfig

REGION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_BOOTSTRAP = 64


class ConfigError(ValueError):
    """A bad setting; str() names the setting and what is wrong with it."""


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
        None, "data directory: identity key, control socket (default: $XDG_DATA_HOME/dtfm "
        "or ~/.local/share/dtfm)", flag="--data-dir", metavar="DIR")
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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        for name in ("retry_initial_s", "retry_max_s", "connect_timeout_s",
                     "exchange_interval_s", "exchange_timeout_s", "leave_timeout_s"):
            _positive("discovery", name, getattr(self, name))
        if self.retry_max_s < self.retry_initial_s:
            raise ConfigError("discovery.retry_max_s must be >= discovery.retry_initial_s")
        if not 1 <= self.exchange_max_peers <= 1024:
            raise ConfigError("discovery.exchange_max_peers must be in 1..1024")
        if not 0 <= self.departed_keep <= 1024:
            raise ConfigError("discovery.departed_keep must be in 0..1024")


@dataclass(frozen=True)
class ControlConfig:
    """The local control socket. TOML table [control]."""

    max_request_bytes: int = option(64 * 1024, "largest request frame the daemon accepts")
    # Status grows with the swarm and with what services add; 4 MiB holds thousands of peers.
    max_response_bytes: int = option(4 * 1024 * 1024, "largest reply frame a client accepts")
    request_timeout_s: float = option(10.0, "a client gives up on a silent daemon after this")
    max_clients: int = option(16, "concurrent control connections; more wait")
    # A client that sends nothing for this long is dropped, freeing its slot.
    idle_timeout_s: float = option(60.0, "close a control connection that is silent this long")

    def __post_init__(self) -> None:
        if not 1024 <= self.max_request_bytes <= 16 * 1024 * 1024:
            raise ConfigError("control.max_request_bytes must be in 1 KiB..16 MiB")
        if not 1024 <= self.max_response_bytes <= 256 * 1024 * 1024:
            raise ConfigError("control.max_response_bytes must be in 1 KiB..256 MiB")
        _positive("control", "request_timeout_s", self.request_timeout_s)
        _positive("control", "idle_timeout_s", self.idle_timeout_s)
        if not 1 <= self.max_clients <= 1024:
            raise ConfigError("control.max_clients must be in 1..1024")


@dataclass(frozen=True)
class LogConfig:
    """Logging. TOML table [log]."""

    level: str = option("info", "log level: debug, info, warning or error", flag="--log-level",
                        metavar="LEVEL")
    json: bool = option(False, "log JSON lines instead of human-readable lines",
                        flag="--log-json")

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise ConfigError(f"log.level {self.level!r}: choose one of {', '.join(LOG_LEVELS)}")


GOSSIP_PROFILES = ("lan", "wan", "local", "test")


@dataclass(frozen=True)
class GossipSection:
    """Membership, failure detection and network measurement. TOML table [gossip]."""

    # lan: memberlist's LAN timings (1 s probes); wan: slow links (5 s probes, more patience);
    # local: one machine (fast probes and gossip, for test swarms).
    profile: str = option("lan", "gossip timing profile: lan, wan or local",
                          flag="--gossip-profile", metavar="NAME")
    # 0 measures this peer's speed with a short torch workload at start (a few seconds);
    # a positive figure skips the probe (and the torch import) and reports it as given.
    compute_ms: float = option(0.0, "this peer's time for one transformer-block forward and "
                               "backward in ms; 0 measures it", flag="--compute-ms", metavar="MS")

    def __post_init__(self) -> None:
        if self.profile not in GOSSIP_PROFILES:
            raise ConfigError(f"gossip.profile {self.profile!r}: choose one of "
                              f"{', '.join(GOSSIP_PROFILES)}")
        if not (math.isfinite(self.compute_ms) and self.compute_ms >= 0):
            raise ConfigError("gossip.compute_ms must be a non-negative number")


@dataclass(frozen=True)
class EmulationSection:
    """Link emulation for test swarms on one machine. TOML table [emulation]."""

    scenario: str = option(
        "", "emulate the links of this scenario (built-in name or TOML file) for every frame "
        "this peer sends; its --region must be one of the scenario's regions",
        flag="--emulate", metavar="SCENARIO")
    # > 1 slows the whole emulated network uniformly (delays x, bandwidth /), so a small model
    # sees the communication-to-compute ratio of a large one.
    time_scale: float = option(1.0, "multiply emulated delays and divide emulated bandwidth "
                               "by this", flag="--time-scale", metavar="X")
    # Loopback and Python crypto carry a few Gbps in all: scale the scenario's links down.
    bandwidth_scale: float = option(1.0, "multiply every emulated bandwidth by this",
                                    flag="--bandwidth-scale", metavar="X")
    drop_fraction: float = option(0.0, "fraction of droppable frames (gossip datagrams) lost",
                                  flag="--drop", metavar="FRACTION")

    def __post_init__(self) -> None:
        _positive("emulation", "time_scale", self.time_scale)
        _positive("emulation", "bandwidth_scale", self.bandwidth_scale)
        if not 0.0 <= self.drop_fraction < 1.0:
            raise ConfigError("emulation.drop_fraction must be in [0, 1)")


@dataclass(frozen=True)
class DaemonConfig:
    """Everything `dtfm-peer join` needs, one section per concern."""

    peer: PeerConfig = PeerConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    control: ControlConfig = ControlConfig()
    log: LogConfig = LogConfig()
    # Frame limits, timeouts, key renewal, handshake admission: see dtfm.net.transport.
    transport: TransportConfig = TransportConfig()
    gossip: GossipSection = GossipSection()
    emulation: EmulationSection = EmulationSection()

    @classmethod
    def default(cls) -> "DaemonConfig":
        return cls()

    @classmethod
    def test(cls) -> "DaemonConfig":
        """Loopback, port 0, fast retries and exchanges: for tests and local swarms."""
        return cls(
            peer=PeerConfig(listen=Address("127.0.0.1", 0)),
            discovery=DiscoveryConfig(retry_initial_s=0.05, retry_max_s=0.5,
                                      connect_timeout_s=2.0, exchange_interval_s=0.5,
                                      exchange_timeout_s=2.0, leave_timeout_s=1.0),
            control=ControlConfig(request_timeout_s=5.0),
            transport=TransportConfig.test(),
        )


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(DaemonConfig)[f.name] for f in dataclasses.fields(DaemonConfig)}


# ---- converting raw values (TOML or flag text) to field types --------------------------------

def _convert(where: str, hint: Any, value: Any, base_dir: Path | None, *,
             text: bool = False) -> Any:
    """`value` as the field type `hint`; `text=True` also parses numbers given as text (flags)."""
    if text and hint in (int, float) and isinstance(value, str):
        try:
            value = hint(value)
        except ValueError:
            raise ConfigError(f"{where} must be {'an integer' if hint is int else 'a number'}, "
                              f"got {value!r}") from None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(where, inner[0], value, base_dir, text=text)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_convert(f"{where}[{i}]", args[0], v, base_dir) for i, v in enumerate(value))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if hint is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where} must be a path, got {value!r}")
        p = Path(value).expanduser()
        return p if p.is_absolute() or base_dir is None else base_dir / p
    if hint is Address:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a \"HOST:PORT\" string, got {value!r}")
        try:
            return Address.parse(value)
        except AddressError as e:
            raise ConfigError(f"{where}: {e}") from None
    raise TypeError(f"{where}: unsupported config field type {hint!r}")


def _build_section(section: str, cls: type, current: Any, raw: dict[str, Any],
                   base_dir: Path | None) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    changes = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"unknown setting {section}.{key}; known: {', '.join(sorted(known))}")
        changes[key] = _convert(f"{section}.{key}", hints[key], value, base_dir)
    try:
        return dataclasses.replace(current, **changes)
    except ConfigError:
        raise
    except ValueError as e:   # AddressError, and checks of sections defined elsewhere
        raise ConfigError(f"[{section}]: {e}") from None


def merge(base: DaemonConfig, raw: dict[str, Any], *, base_dir: Path | None = None) -> DaemonConfig:
    """Apply a nested mapping (`{"peer": {"region": "eu"}}`) onto `base`; validated.

    Relative paths resolve against `base_dir` (the config file's folder) when given.
    """
    if not isinstance(raw, dict):
        raise ConfigError("configuration must be a table")
    sections = {}
    for name, table in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}]; known: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] must be a table")
        sections[name] = _build_section(name, SECTIONS[name], getattr(base, name), table,
                                        base_dir)
    return dataclasses.replace(base, **sections)


def load_toml(path: Path, base: DaemonConfig | None = None) -> DaemonConfig:
    """Read a TOML config file onto `base` (default profile); ConfigError names the file."""
    base = DaemonConfig.default() if base is None else base
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    try:
        return merge(base, raw, base_dir=path.resolve().parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def flag_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section name, field) for every field that is also a command-line flag."""
    out = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag"):
                out.append((section, f))
    return out


def dest_name(section: str, f: dataclasses.Field) -> str:
    return f"cfg__{section}__{f.name}"


def apply_flags(base: DaemonConfig, namespace: Any) -> DaemonConfig:
    """`base` with the flags given on the command line applied (absent flags keep base's).

    Flag values arrive as text (a list of texts for repeatable flags, True for switches);
    errors name the flag. Relative paths stay relative to the working directory.
    """
    changes: dict[str, dict[str, Any]] = {}
    for section, f in flag_fields():
        value = getattr(namespace, dest_name(section, f), None)
        if value is None:
            continue
        hint = typing.get_type_hints(SECTIONS[section])[f.name]
        typed = _convert(f.metadata["flag"], hint, value, None, text=True)
        changes.setdefault(section, {})[f.name] = typed
    sections = {}
    for section, fields in changes.items():
        try:
            sections[section] = dataclasses.replace(getattr(base, section), **fields)
        except AddressError as e:
            raise ConfigError(str(e)) from None
        except ConfigError:
            raise
        except ValueError as e:   # checks of sections defined elsewhere
            raise ConfigError(f"{e}") from None
    return dataclasses.replace(base, **sections)


def default_text(section: str, f: dataclasses.Field) -> str:
    value = getattr(getattr(DaemonConfig.default(), section), f.name)
    if value is None or value == () or value == "":
        return ""
    if isinstance(value, bool):
        return ""
    return f" (default: {value})"
