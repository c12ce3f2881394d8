"""Daemon configuration: defaults < TOML file < command-line flags, with validation."""

import dataclasses
import functools
import inspect
import json
import math
from pathlib import Path

import pytest

from dtfm.control import CommConfig, ElectionConfig, PlaneConfig
from dtfm.gossip import GossipConfig
from dtfm.net import EmulationConfig
from dtfm.net.addr import Address, AddressError
from dtfm.peer.cli import build_parser
from dtfm.peer.config import (
    ELECTION_PROFILES,
    GOSSIP_PROFILES,
    PLANE_PROFILES,
    ConfigError,
    DaemonConfig,
    DiscoveryConfig,
    EmulationSection,
    GossipSection,
    LogConfig,
    PeerConfig,
    PlaneSection,
)
from dtfm.peer.paths import DataDir, DataDirError, DataDirLock, default_data_dir
from dtfm.peer.services import codec_speed_setting, gossip_config, layer_probe_setting, measure_codec_ns
from dtfm.peer.settings import apply_flags, flag_settings, load_toml, merge, section_settings


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
    ('[socket]\nmax_request_bytes = 10\n', "socket.max_request_bytes"),
    ('[control]\nmax_clients = 4\n', r"\[control\] is now \[socket\]"),
    ('[trainer]\ntorch_threads = 2\n', r"\[trainer\] is now \[plane\]"),
    ('[plane]\ntorch_threads = 0\n', "plane.torch_threads"),
    ('[plane]\nelection.nope = 1\n', r"unknown setting plane\.election\.nope"),
    ('[plane]\ndata = "absent"\n', r"plane\.data \(--data\) .*absent: no such file or folder"),
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


def join_help() -> str:
    return " ".join(build_parser()._subparsers._group_actions[0].choices["join"].format_help().split())


def test_every_flag_field_appears_in_join_help():
    help_text = join_help()
    for s in flag_settings():
        assert s.flag in help_text
    assert "(default: 0.0.0.0:7450)" in help_text   # taken from the dataclass default
    assert f"(default: {EmulationConfig().time_scale})" in help_text   # the emulator's own default


def test_default_data_dir():
    assert default_data_dir({"XDG_DATA_HOME": "/x/data", "HOME": "/h"}) == Path("/x/data/dtfm")
    assert default_data_dir({"HOME": "/h"}) == Path("/h/.local/share/dtfm")
    assert default_data_dir({"XDG_DATA_HOME": "rel", "HOME": "/h"}) == Path("/h/.local/share/dtfm")
    # several daemons on one host: each shell names its own (operator review L7)
    assert default_data_dir({"DTFM_DATA_DIR": "/srv/b", "XDG_DATA_HOME": "/x/data", "HOME": "/h"}) == Path("/srv/b")
    assert default_data_dir({"DTFM_DATA_DIR": "", "HOME": "/h"}) == Path("/h/.local/share/dtfm")


def test_the_data_dir_variable_reaches_every_command_below_the_flag(tmp_path, monkeypatch, capsys):
    from dtfm.peer.cli import main
    monkeypatch.setenv("DTFM_DATA_DIR", str(tmp_path / "b"))
    assert main(["keygen", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data_dir"] == str(tmp_path / "b")
    assert main(["status"]) == 1  # no daemon there: the error names the variable's dir
    assert f"no daemon is running for data dir {tmp_path / 'b'}" in capsys.readouterr().err
    assert main(["status", "--data-dir", str(tmp_path / "a")]) == 1  # the flag wins
    assert f"data dir {tmp_path / 'a'}" in capsys.readouterr().err


def test_data_dir_modes_and_lock(tmp_path):
    root = tmp_path / "d"
    root.mkdir(mode=0o755)
    data_dir = DataDir(root)
    data_dir.ensure()
    assert root.stat().st_mode & 0o777 == 0o700
    assert data_dir.control_dir.stat().st_mode & 0o777 == 0o700
    probe = DataDirLock(data_dir)
    assert not probe.in_use()  # no lock file yet
    with DataDirLock(data_dir):
        assert probe.in_use()  # what `leave` waits on
        with pytest.raises(DataDirError, match="already running for data dir"):
            DataDirLock(data_dir).acquire()
    assert not probe.in_use()
    with DataDirLock(data_dir):   # released (the probe took nothing): can be taken again
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
    with pytest.raises(ConfigError, match=r"transport.idle_timeout_s: idle_timeout_s must exceed"):
        load_toml(path)


# ---- [gossip] and [emulation]: the lower layers' own config classes --------------------------

def test_profiles_are_gossip_configs_named_profiles():
    # Every no-argument classmethod of GossipConfig that builds one is a profile.
    expected = tuple(name for name, attr in vars(GossipConfig).items()
                     if isinstance(attr, classmethod) and not inspect.signature(getattr(GossipConfig, name)).parameters)
    assert set(expected) >= {"lan", "wan", "local", "test"}
    assert GOSSIP_PROFILES == expected
    assert f"gossip timing profile: {', '.join(expected[:-1])} or {expected[-1]}" in join_help()
    with pytest.raises(ConfigError) as info:
        apply_flags(DaemonConfig(), join_args("--gossip-profile", "moon"))
    assert str(info.value) == f"gossip.profile 'moon': choose one of {', '.join(expected)}"
    for name in expected:
        cfg = apply_flags(DaemonConfig(), join_args("--gossip-profile", name))
        assert cfg.gossip.settings == getattr(GossipConfig, name)()


def test_gossip_table_sets_fields_over_the_profile_whichever_layer_picks_it(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text('[gossip]\nprobe_timeout_s = 0.8\nrecord_skew_s = 900\ncompute_ms = 12.5\n')
    cfg = load_toml(path)
    assert cfg.gossip.settings == GossipConfig.lan().with_(probe_timeout_s=0.8, record_skew_s=900.0)
    assert cfg.gossip.compute_ms == 12.5
    cfg = apply_flags(cfg, join_args("--gossip-profile", "wan"))
    assert cfg.gossip.settings == GossipConfig.wan().with_(probe_timeout_s=0.8, record_skew_s=900.0)
    assert gossip_config(cfg) == cfg.gossip.settings   # fits the transport's frames: unchanged


def test_gossip_sync_bytes_are_capped_by_the_transport_frame(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text('[transport]\nmax_control_frame_bytes = 131072\n')
    assert gossip_config(load_toml(path)).max_sync_bytes == 65536


def load_toml_config(tmp_path: Path, text: str) -> DaemonConfig:
    path = tmp_path / "w.toml"
    path.write_text(text)
    return load_toml(path)


def test_the_data_planes_window_fits_the_transports_payloads_and_handlers(tmp_path):
    """8 tensors in flight by default, a wider window settable up to half of the 64 incomplete
    payloads and handlers the transport allows per connection; a window the transport could not
    take is refused at once, naming both sides."""
    assert load_toml_config(tmp_path, "").plane.settings.comm.window_messages == 8
    with pytest.raises(ConfigError, match="plane.comm.window_messages 8: at most half of transport.max_inflight_payloads"):
        load_toml_config(tmp_path, "[transport]\nmax_inflight_payloads = 8\n")
    with pytest.raises(ConfigError, match="max_concurrent_handlers"):
        load_toml_config(tmp_path, "[plane.comm]\nwindow_messages = 32\n[transport]\nmax_concurrent_handlers = 48\n")
    assert load_toml_config(tmp_path, "[plane.comm]\nwindow_messages = 32\n")  # half of 64: room enough
    assert load_toml_config(tmp_path, "[plane.comm]\nwindow_messages = 4\n[transport]\nmax_inflight_payloads = 8\n")


def test_emulation_table_and_flags_map_onto_emulation_config(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text('[emulation]\nscenario = "worldwide"\ntime_scale = 2\nqueue_frames = 64\n'
                    'share_region_bandwidth = true\n')
    cfg = load_toml(path)
    assert cfg.emulation.scenario == "worldwide"
    assert cfg.emulation.settings == EmulationConfig(time_scale=2.0, queue_frames=64,
                                                     share_region_bandwidth=True)
    cfg = apply_flags(cfg, join_args("--bandwidth-scale", "0.05", "--drop", "0.1"))
    assert cfg.emulation.settings == EmulationConfig(time_scale=2.0, bandwidth_scale=0.05, drop_fraction=0.1,
                                                     queue_frames=64, share_region_bandwidth=True)
    assert DaemonConfig().emulation.settings == EmulationConfig()


def test_table_keys_are_the_lower_layers_fields():
    gossip = section_settings("gossip")
    emulation = section_settings("emulation")
    assert set(gossip) == {"profile", "compute_ms", "codec_speed", "layer_probe", "kinds_file"} | {f.name for f in dataclasses.fields(GossipConfig)}
    assert set(emulation) == {"scenario"} | {f.name for f in dataclasses.fields(EmulationConfig)}
    with pytest.raises(ConfigError, match="unknown setting emulation.nope"):
        merge(DaemonConfig(), {"emulation": {"nope": 1}})


def _bad_values(config_cls, base):
    """(key, value) pairs that the lower layer's own config class refuses on top of `base`:
    every check it makes on a single field, found by trying values, not by listing them."""
    tries = (math.nan, math.inf, -1, 0, 0.5, 1, 1.5, 2 ** 40)
    found = []
    for f in dataclasses.fields(config_cls):
        kind = type(getattr(base, f.name))
        for value in tries:
            if kind is int and not (isinstance(value, int) or math.isfinite(value) and value == int(value)):
                continue
            if kind not in (int, float):  # bools, and PlaneConfig's path and nested configs
                continue
            typed = kind(value) if math.isfinite(value) else value
            try:
                dataclasses.replace(base, **{f.name: typed})
            except ValueError:
                found.append((f.name, typed))
    return found


GOSSIP_BAD = _bad_values(GossipConfig, GossipConfig.lan())
EMULATION_BAD = _bad_values(EmulationConfig, EmulationConfig())
PLANE_BAD = (_bad_values(PlaneConfig, PlaneConfig.wan())
             + [(f"election.{k}", v) for k, v in _bad_values(ElectionConfig, ElectionConfig.wan())]
             + [(f"comm.{k}", v) for k, v in _bad_values(CommConfig, CommConfig())])


def test_the_lower_layers_do_refuse_values():
    gossip_keys = {k for k, _ in GOSSIP_BAD}
    assert {"probe_interval_s", "probe_timeout_s", "measure_jitter", "rtt_samples",
            "suspicion_max_timeout_mult"} <= gossip_keys
    assert {k for k, _ in EMULATION_BAD} >= {"time_scale", "bandwidth_scale", "drop_fraction",
                                              "burst_bytes", "queue_frames"}
    assert {"torch_threads", "report_gather_s", "probe_timeout_s", "max_reconfig_attempts",
            "election.lease_s", "comm.window_messages"} <= {k for k, _ in PLANE_BAD}


@pytest.mark.parametrize("section,key,value", [("gossip", k, v) for k, v in GOSSIP_BAD]
                         + [("emulation", k, v) for k, v in EMULATION_BAD]
                         + [("plane", k, v) for k, v in PLANE_BAD])
def test_lower_layer_refusals_are_config_errors_naming_the_key(tmp_path, section, key, value):
    with pytest.raises(ConfigError, match=rf"\b{section}\.{key}\b"):
        merge(DaemonConfig(), {section: {key: value}})
    # The same through a file, where the message also names the file.
    path = tmp_path / "bad.toml"
    text = "nan" if value != value else ("inf" if value == math.inf else repr(value))
    path.write_text(f"[{section}]\n{key} = {text}\n")
    with pytest.raises(ConfigError, match=rf"{path}: .*\b{section}\.{key}\b"):
        load_toml(path)


@pytest.mark.parametrize("flag,value,key", [
    ("--time-scale", "0", "emulation.time_scale"),
    ("--bandwidth-scale", "-1", "emulation.bandwidth_scale"),
    ("--drop", "1.5", "emulation.drop_fraction"),
    ("--time-scale", "nan", "emulation.time_scale"),
    ("--compute-ms", "-3", "gossip.compute_ms"),
    ("--torch-threads", "0", "plane.torch_threads"),
])
def test_flag_values_the_lower_layers_refuse_name_the_key(flag, value, key):
    with pytest.raises(ConfigError, match=key):
        apply_flags(DaemonConfig(), join_args(flag, value))


def test_gossip_override_that_conflicts_with_a_later_profile_names_it():
    cfg = merge(DaemonConfig(), {"gossip": {"profile": "wan", "probe_timeout_s": 4.0}})
    with pytest.raises(ConfigError, match=r"^gossip\.probe_timeout_s: probe_timeout_s must be"):
        apply_flags(cfg, join_args("--gossip-profile", "lan"))


def test_sections_build_directly():
    assert GossipSection(profile="test").settings == GossipConfig.test()
    with pytest.raises(ConfigError, match="gossip.rtt_samples"):
        GossipSection(overrides=(("rtt_samples", 0),))
    assert EmulationSection().with_settings(drop_fraction=0.5).settings.drop_fraction == 0.5


# ---- [plane]: dtfm.control.PlaneConfig -----------------------------------------------------

def test_plane_profiles_are_plane_configs_named_profiles():
    assert PLANE_PROFILES == ("lan", "wan", "test")
    assert "control plane timing profile: lan, wan or test" in join_help()
    assert DaemonConfig().plane.settings == PlaneConfig.wan() == PlaneConfig()
    assert DaemonConfig.test().plane.settings == PlaneConfig.test()
    for name in PLANE_PROFILES:
        cfg = apply_flags(DaemonConfig(), join_args("--plane-profile", name))
        assert cfg.plane.settings == getattr(PlaneConfig, name)()
    with pytest.raises(ConfigError) as info:
        apply_flags(DaemonConfig(), join_args("--plane-profile", "moon"))
    assert str(info.value) == "plane.profile 'moon': choose one of lan, wan, test"


def test_plane_profiles_keep_the_waits_that_follow_the_election():
    for name in PLANE_PROFILES:
        p = getattr(PlaneConfig, name)()
        assert p.coordinator_check_s == pytest.approx(5 * p.election.heartbeat_interval_s)
        assert p.coordinator_lost_after_s == pytest.approx(3 * p.election.election_timeout_max_s)
        assert p.heartbeat_wait_s == pytest.approx(2 * p.election.heartbeat_interval_s + 1.0)
    assert PlaneConfig.wan().election == ElectionConfig.wan()
    assert PlaneConfig.lan().election == PlaneConfig.test().election == ElectionConfig.lan()
    # The named waits are today's bare numbers under wan.
    wan = PlaneConfig.wan()
    assert (wan.report_gather_s, wan.probe_timeout_s, wan.paused_retry_s, wan.stop_poll_s, wan.swarm_poll_s,
            wan.max_reconfig_attempts) == (0.5, 5.0, 6 * wan.check_interval_s, 0.2, 1.0, 5)
    assert wan.forward_timeout_s == wan.accept_timeout_s + 60
    assert (wan.coordinator_check_s, wan.coordinator_lost_after_s, wan.heartbeat_wait_s) == (1.0, 6.9, 1.4)


def test_plane_election_profile_brings_its_waits_and_overrides_still_win():
    cfg = apply_flags(DaemonConfig(), join_args("--plane-profile", "test", "--election-profile", "wan"))
    assert cfg.plane.settings == PlaneConfig.test().with_election(ElectionConfig.wan())
    assert cfg.plane.settings.coordinator_lost_after_s == PlaneConfig.wan().coordinator_lost_after_s
    assert cfg.plane.settings.check_interval_s == PlaneConfig.test().check_interval_s
    assert set(ELECTION_PROFILES) == {"lan", "wan", "test"}
    with pytest.raises(ConfigError, match=r"plane\.election_profile 'moon': choose one of"):
        apply_flags(DaemonConfig(), join_args("--election-profile", "moon"))
    cfg = merge(cfg, {"plane": {"coordinator_lost_after_s": 9.0}})
    assert cfg.plane.settings.coordinator_lost_after_s == 9.0


def test_plane_table_sets_fields_and_nested_fields_over_the_profile(tmp_path):
    (tmp_path / "corpus.txt").write_text("text")
    path = tmp_path / "p.toml"
    path.write_text('[plane]\nprofile = "lan"\ndata = "corpus.txt"\ntorch_threads = 2\n'
                    'report_gather_s = 0.25\nelection.stagger_s = 0.2\n'
                    '[plane.comm]\nwindow_messages = 4\n')
    cfg = load_toml(path)
    lan = PlaneConfig.lan()
    expected = lan.with_(data_path=str(tmp_path / "corpus.txt"), torch_threads=2, report_gather_s=0.25,
                         election=lan.election.with_(stagger_s=0.2),
                         comm=dataclasses.replace(lan.comm, window_messages=4))
    assert cfg.plane.settings == expected
    # A later profile keeps the table's fields.
    cfg = apply_flags(cfg, join_args("--plane-profile", "wan"))
    assert cfg.plane.settings.election == ElectionConfig.wan().with_(stagger_s=0.2)
    assert cfg.plane.settings.report_gather_s == 0.25
    keys = section_settings("plane")
    assert {"profile", "election_profile", "data", "election.lease_s", "comm.ack_timeout_s"} <= set(keys)
    assert "data_path" not in keys and "election" not in keys


def test_plane_refusal_of_a_nested_field_names_it():
    with pytest.raises(ConfigError, match=r"^plane\.election\.lease_s: lease_s must exceed"):
        merge(DaemonConfig(), {"plane": {"election": {"lease_s": 5.0}, "check_interval_s": 2.0}})


def test_join_data_that_does_not_exist_fails_at_once_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError) as info:
        apply_flags(DaemonConfig(), join_args("--data", str(tmp_path / "nonexistent")))
    assert str(info.value) == (f"plane.data (--data) {tmp_path / 'nonexistent'}: no such file or folder; "
                               "give the text file or folder of text files this peer trains on")
    # an empty file (a corpus not copied yet) was accepted and refused only at `train start`,
    # after its --min-peers wait
    (tmp_path / "corpus.txt").touch()
    with pytest.raises(ConfigError, match=r"corpus\.txt: the file is empty"):
        apply_flags(DaemonConfig(), join_args("--data", str(tmp_path / "corpus.txt")))
    cfg = apply_flags(DaemonConfig(), join_args("--data", str(tmp_path), "--torch-threads", "3"))
    assert cfg.plane.settings.data_path == str(tmp_path) and cfg.plane.settings.torch_threads == 3


def test_plane_section_builds_directly():
    assert PlaneSection(profile="test").settings == PlaneConfig.test()
    with pytest.raises(ConfigError, match="plane.max_reconfig_attempts"):
        PlaneSection(overrides=(("max_reconfig_attempts", 0),))


def test_the_coding_speed_is_measured_by_default_or_given(tmp_path):
    from dtfm.sched import REFERENCE_CODEC_SPEED, CodecSpeed
    ns, probe = codec_speed_setting(DaemonConfig())
    assert DaemonConfig().gossip.codec_speed == "measure" and ns is None
    assert isinstance(probe, functools.partial) and probe.func is measure_codec_ns and probe.args == (1, "cpu")  # torch threads, device
    cfg = apply_flags(DaemonConfig(), join_args("--codec-speed", "reference", "--torch-threads", "2"))
    assert codec_speed_setting(cfg) == (REFERENCE_CODEC_SPEED.to_vector(), None)
    assert codec_speed_setting(merge(DaemonConfig(), {"gossip": {"codec_speed": "free"}})) == ((0.0,) * 7, None)
    assert codec_speed_setting(merge(DaemonConfig(), {"plane": {"torch_threads": 3}}))[1].args == (3, "cpu")
    # a GPU stage codes on its GPU: the probe measures there
    assert codec_speed_setting(merge(DaemonConfig(), {"plane": {"device": "cuda:1"}}))[1].args == (1, "cuda:1")
    path = tmp_path / "speed.json"
    path.write_text(json.dumps({**REFERENCE_CODEC_SPEED.to_dict(), "sparse_encode_ns_per_elem": 99.0}))
    ns, probe = codec_speed_setting(apply_flags(DaemonConfig(), join_args("--codec-speed", str(path))))
    assert probe is None and CodecSpeed.from_vector(ns).sparse_encode_ns_per_elem == 99.0
    for text, why in (("[1, 2]", "not a codec speed"), ('{"int9": 1}', "not a codec speed"),
                      ('{"int8_encode_ns_per_elem": -1}', "not a codec speed"), ("{", "not a codec speed")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"gossip.codec_speed \(--codec-speed\) .*{why}"):
            codec_speed_setting(apply_flags(DaemonConfig(), join_args("--codec-speed", str(path))))
    with pytest.raises(ConfigError, match="cannot read it"):
        codec_speed_setting(apply_flags(DaemonConfig(), join_args("--codec-speed", str(tmp_path / "none.json"))))
    with pytest.raises(ConfigError, match="gossip.codec_speed"):
        merge(DaemonConfig(), {"gossip": {"codec_speed": ""}})


def test_the_log_file_and_its_rotation_are_checked(tmp_path):
    cfg = apply_flags(DaemonConfig(), join_args("--log-file", str(tmp_path / "d.log"), "--log-max-mb", "0.5",
                                                "--log-backups", "0"))
    assert (cfg.log.file, cfg.log.max_mb, cfg.log.backups) == (tmp_path / "d.log", 0.5, 0)
    assert DaemonConfig().log.file is None  # (stderr, for a supervisor)
    for bad in ({"max_mb": 0}, {"max_mb": float("nan")}, {"backups": -1}):
        with pytest.raises(ConfigError, match="log.max_mb must be a positive number and log.backups >= 0"):
            merge(DaemonConfig(), {"log": bad})


def test_the_layer_probe_is_on_by_default_and_can_be_turned_off(tmp_path):
    from dtfm.peer.speed import KIND_FILE, KindCache
    probe = layer_probe_setting(merge(DaemonConfig(), {"plane": {"torch_threads": 2}}), tmp_path)
    assert isinstance(probe, KindCache) and probe.path == tmp_path / KIND_FILE and probe.key.torch_threads == 2
    assert layer_probe_setting(apply_flags(DaemonConfig(), join_args("--layer-probe", "off")), tmp_path) is None
    shared = layer_probe_setting(apply_flags(DaemonConfig(), join_args("--kinds-file", str(tmp_path / "k.json"))),
                                 tmp_path / "data")
    assert isinstance(shared, KindCache) and shared.path == tmp_path / "k.json"
    with pytest.raises(ConfigError, match="gossip.layer_probe 'sometimes': choose measure or off"):
        merge(DaemonConfig(), {"gossip": {"layer_probe": "sometimes"}})


@pytest.mark.parametrize("profile", ["lan", "wan", "test"])
def test_the_coordinator_timings_are_the_plane_settings_of_the_same_name(profile):
    """One mapping (`PlaneConfig.coordinator_timings`) for the daemon's shell and the
    simulation: every timing the coordinator machine has is the plane's setting of that name,
    and its step deadline is the three step_deadline_* settings."""
    cfg = getattr(PlaneConfig, profile)()
    t = cfg.coordinator_timings()
    named = [f.name for f in dataclasses.fields(t) if hasattr(cfg, f.name)]
    assert len(named) >= 18
    for name in named:
        assert getattr(t, name) == getattr(cfg, name), name
    assert t.deadline is not None
    assert (t.deadline.floor_s, t.deadline.mads, t.deadline.first_s) == (
        cfg.step_deadline_floor_s, cfg.step_deadline_mads, cfg.step_deadline_first_s)
    unmapped = {f.name for f in dataclasses.fields(t)} - set(named) - {"deadline"}
    assert unmapped == {"leaving_kept_s"}  # (no setting: the machine's own default)
