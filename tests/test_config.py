"""Daemon configuration: defaults < TOML file < command-line flags, with validation."""

import dataclasses
from pathlib import Path

import pytest

from dtfm.net.addr import Address, AddressError
from dtfm.peer.cli import build_parser
from dtfm.peer.config import (
    ConfigError,
    DaemonConfig,
    DiscoveryConfig,
    LogConfig,
    PeerConfig,
    apply_flags,
    flag_fields,
    load_toml,
    merge,
)
from dtfm.peer.paths import DataDir, DataDirError, DataDirLock, default_data_dir


def join_args(*argv):
    return build_parser().parse_args(["join", *argv])


@pytest.mark.parametrize("text,expected", [
    ("127.0.0.1:7450", Address("127.0.0.1", 7450)),
    ("example.org:0", Address("example.org", 0)),
    ("[::1]:9", Address("::1", 9)),
    (" host:1 ", Address("host", 1)),
])
def test_address_parse(text, expected):
    assert Address.parse(text) == expected
    assert Address.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["nohost", ":7450", "h:", "h:x", "h:65536", "::1:80", "[::1]80",
                                  "a b:1", "h:-1"])
def test_address_parse_rejects(text):
    with pytest.raises(AddressError):
        Address.parse(text)


def test_unspecified_addresses():
    assert Address("0.0.0.0", 1).is_unspecified
    assert Address("::", 1).is_unspecified
    assert not Address("127.0.0.1", 1).is_unspecified
    assert not Address("example.org", 1).is_unspecified


def test_toml_overrides_defaults_and_resolves_relative_paths(tmp_path):
    (tmp_path / "peer.toml").write_text(
        '[peer]\nlisten = "127.0.0.1:9000"\nbootstrap = ["10.0.0.1:7450", "[::1]:7451"]\n'
        'swarm_key_file = "keys/swarm.key"\nregion = "eu-west"\n'
        '[discovery]\nretry_max_s = 60\n[log]\njson = true\n')
    cfg = load_toml(tmp_path / "peer.toml")
    assert cfg.peer.listen == Address("127.0.0.1", 9000)
    assert cfg.peer.bootstrap == (Address("10.0.0.1", 7450), Address("::1", 7451))
    assert cfg.peer.swarm_key_file == tmp_path / "keys" / "swarm.key"
    assert cfg.peer.region == "eu-west"
    assert cfg.discovery.retry_max_s == 60.0
    assert isinstance(cfg.discovery.retry_max_s, float)
    assert cfg.discovery.retry_initial_s == DiscoveryConfig().retry_initial_s
    assert cfg.log == LogConfig(level="info", json=True)


def test_flags_win_over_toml(tmp_path):
    (tmp_path / "peer.toml").write_text(
        '[peer]\nlisten = "127.0.0.1:9000"\nregion = "eu"\nbootstrap = ["10.0.0.1:1"]\n'
        '[log]\nlevel = "debug"\n')
    args = join_args("--config", str(tmp_path / "peer.toml"), "--region", "us",
                     "--bootstrap", "a:1", "--bootstrap", "b:2", "--log-json")
    cfg = apply_flags(load_toml(args.config), args)
    assert cfg.peer.region == "us"
    assert cfg.peer.bootstrap == (Address("a", 1), Address("b", 2))
    assert cfg.peer.listen == Address("127.0.0.1", 9000)   # not given: the file's value stays
    assert cfg.log == LogConfig(level="debug", json=True)


def test_no_flags_keeps_base():
    base = DaemonConfig.test()
    assert apply_flags(base, join_args()) == base


def test_flag_values_are_checked_and_named():
    with pytest.raises(ConfigError, match="--listen"):
        apply_flags(DaemonConfig(), join_args("--listen", "nowhere"))
    with pytest.raises(ConfigError, match="region"):
        apply_flags(DaemonConfig(), join_args("--region", "has space"))
    with pytest.raises(ConfigError, match="log.level"):
        apply_flags(DaemonConfig(), join_args("--log-level", "loud"))


@pytest.mark.parametrize("toml,message", [
    ('[peer]\nport = 1\n', "unknown setting peer.port"),
    ('[nosuch]\nx = 1\n', r"unknown section \[nosuch\]"),
    ('peer = 3\n', r"\[peer\] must be a table"),
    ('[peer]\nlisten = 7450\n', "peer.listen must be a \"HOST:PORT\""),
    ('[peer]\nbootstrap = "a:1"\n', "peer.bootstrap must be a list"),
    ('[peer]\nbootstrap = ["a"]\n', r"peer.bootstrap\[0\]"),
    ('[discovery]\nretry_initial_s = -1\n', "retry_initial_s must be a positive"),
    ('[discovery]\nretry_initial_s = 10\nretry_max_s = 1\n', "retry_max_s must be >="),
    ('[discovery]\nexchange_max_peers = 1.5\n', "must be an integer"),
    ('[discovery]\nexchange_max_peers = true\n', "must be an integer"),
    ('[log]\njson = "yes"\n', "must be true or false"),
    ('[control]\nmax_request_bytes = 10\n', "max_request_bytes"),
    ('[peer\n', "not valid TOML"),
])
def test_bad_toml_is_refused_with_its_name(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message) as info:
        load_toml(path)
    assert str(path) in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "absent.toml")


def test_dataclasses_validate_directly():
    with pytest.raises(ConfigError):
        DiscoveryConfig(exchange_interval_s=float("nan"))
    with pytest.raises(ConfigError):
        PeerConfig(region="x" * 65)
    with pytest.raises(AddressError):
        Address("h", 70000)
    cfg = DaemonConfig.test()
    assert cfg.peer.listen.port == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.peer = PeerConfig()  # type: ignore[misc]


def test_merge_equals_field_by_field_replace():
    cfg = merge(DaemonConfig(), {"peer": {"region": "ap"}, "discovery": {"exchange_max_peers": 9}})
    assert cfg == dataclasses.replace(
        DaemonConfig(), peer=PeerConfig(region="ap"),
        discovery=DiscoveryConfig(exchange_max_peers=9))


def test_every_flag_field_appears_in_join_help():
    help_text = build_parser()._subparsers._group_actions[0].choices["join"].format_help()
    for _section, f in flag_fields():
        assert f.metadata["flag"] in help_text
    assert "(default: 0.0.0.0:7450)" in help_text   # taken from the dataclass default


def test_default_data_dir():
    assert default_data_dir({"XDG_DATA_HOME": "/x/data", "HOME": "/h"}) == Path("/x/data/dtfm")
    assert default_data_dir({"HOME": "/h"}) == Path("/h/.local/share/dtfm")
    assert default_data_dir({"XDG_DATA_HOME": "rel", "HOME": "/h"}) == Path("/h/.local/share/dtfm")


def test_data_dir_modes_and_lock(tmp_path):
    root = tmp_path / "d"
    root.mkdir(mode=0o755)
    data_dir = DataDir(root)
    data_dir.ensure()
    assert root.stat().st_mode & 0o777 == 0o700
    assert data_dir.control_dir.stat().st_mode & 0o777 == 0o700
    with DataDirLock(data_dir):
        with pytest.raises(DataDirError, match="already running for data dir"):
            DataDirLock(data_dir).acquire()
    with DataDirLock(data_dir):   # released: can be taken again
        pass


def test_overlong_socket_path_is_a_clear_error(tmp_path):
    with pytest.raises(DataDirError, match="shorter --data-dir"):
        DataDir(tmp_path / ("x" * 120)).check_socket_path()


def test_transport_section_maps_onto_transport_config(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text("[transport]\nrequest_timeout_s = 7\nmax_half_open_handshakes = 8\n")
    cfg = load_toml(path)
    assert cfg.transport.request_timeout_s == 7.0
    assert cfg.transport.max_half_open_handshakes == 8
    path.write_text("[transport]\nkeepalive_interval_s = 50\nidle_timeout_s = 60\n")
    with pytest.raises(ConfigError, match=r"\[transport\]: idle_timeout_s must exceed"):
        load_toml(path)
