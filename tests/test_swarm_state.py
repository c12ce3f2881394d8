"""dtfm-swarm's pure parts: run-dir state, peer lookup, the measured view in scenario units."""

import os
import stat
import tempfile
from pathlib import Path

import pytest

from dtfm.swarm import cli as swarm
from dtfm.swarm.proc import gossip_profile, plane_flags
from dtfm.swarm.report import DEMO_PRESET, demo_model, measured_matrices
from dtfm.swarm.state import (
    KEY_FILE,
    PeerEntry,
    SwarmError,
    SwarmState,
    default_run_dir,
    ensure_run_dir,
    load_state,
    save_state,
    write_secret_file,
)
from dtfm.train import get_preset


def make_state(tmp_path):
    state = SwarmState(scenario="worldwide", scenario_name="worldwide", time_scale=2.0,
                       bandwidth_scale=0.1)
    for k, region in enumerate(["Oregon", "Tokyo", "Tokyo"]):
        state.peers.append(PeerEntry(name=f"p{k:02d}", index=k, region=region, port=9000 + k,
                                     data_dir=str(tmp_path / f"p{k:02d}"),
                                     peer_id=f"{k:02d}" * 32))
    return state


def test_state_round_trips_through_the_run_dir(tmp_path):
    state = make_state(tmp_path)
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    assert not list(tmp_path.glob(".swarm.*.tmp"))


def test_missing_run_dir_says_how_to_start(tmp_path):
    with pytest.raises(SwarmError, match="dtfm-swarm up"):
        load_state(tmp_path / "nothing")


def test_find_by_name_index_and_id_prefix(tmp_path):
    state = make_state(tmp_path)
    assert state.find("p01").index == 1
    assert state.find("2").name == "p02"
    assert state.find("0101").name == "p01"
    with pytest.raises(SwarmError, match="no peer"):
        state.find("p09")


def test_measured_view_is_reordered_and_unscaled(tmp_path):
    state = make_state(tmp_path)
    ids = [p.peer_id for p in state.peers]
    # The observer lists peers in another order: p02, p00, p01.
    view_order = [ids[2], ids[0], ids[1]]
    raw_delay = {(a, b): 10.0 * (1 + a + b) for a in range(3) for b in range(3) if a != b}
    matrix = [[0.0 if a == b else raw_delay[(a, b)] for b in range(3)] for a in range(3)]
    report = {"gossip": {"view": {"peers": view_order, "delay_ms": matrix,
                                  "bandwidth_gbps": [[None, 0.05, 0.05], [0.05, None, 0.02],
                                                     [0.05, 0.02, None]],
                                  "complete": True}}}
    m = measured_matrices(report, ids, time_scale=2.0, bandwidth_scale=0.1)
    # p00 is row 1 of the observer's view, p01 row 2: raw 10 * (1 + 1 + 2) = 40 ms, / time scale.
    assert m["raw_delay_ms"][0][1] == 40.0
    assert m["delay_ms"][0][1] == 20.0
    # Bandwidth back in scenario units: raw x time_scale / bandwidth_scale.
    assert m["bandwidth_gbps"][0][1] == pytest.approx(0.02 * 2.0 / 0.1)
    assert m["complete"] is True
    missing = measured_matrices(report, ids + ["ff" * 32], 1.0, 1.0)
    assert missing["delay_ms"][3][0] is None


def test_cli_errors_are_one_line_without_traceback(tmp_path, capsys):
    assert swarm.main(["status", "--run-dir", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dtfm-swarm: error: no swarm in {tmp_path / 'none'}") and err.count("\n") == 1


@pytest.mark.parametrize("flags,message", [
    (["--scenario", "atlantis"], "no scenario 'atlantis'"),
    (["--peers", "1"], "--peers must be between 2 and 256"),
    (["--time-scale", "0"], "--time-scale / --bandwidth-scale: time_scale must be a positive number"),
    (["--bandwidth-scale", "nan"], "bandwidth_scale must be a positive number"),
])
def test_up_refuses_bad_settings_before_starting_peers(tmp_path, capsys, flags, message):
    run_dir = tmp_path / "run"
    assert swarm.main(["up", "--run-dir", str(run_dir), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dtfm-swarm: error: ") and message in err and err.count("\n") == 1
    assert not run_dir.exists()


def test_bad_command_line_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        swarm.main(["up", "--peers", "many"])
    assert info.value.code == 2
    assert "dtfm-swarm up: error: argument --peers" in capsys.readouterr().err


def test_demo_model_is_trains_preset():
    gpt = get_preset(DEMO_PRESET)
    spec = demo_model(6)
    assert (spec.name, spec.layers, spec.hidden, spec.heads, spec.seq_len, spec.vocab) == (
        gpt.name, gpt.n_layer, gpt.n_embd, gpt.n_head, gpt.seq_len, gpt.vocab)
    assert spec.global_batch_seqs == 48


@pytest.mark.parametrize("scenario,emulated,profile,flags", [
    # worldwide round trips (up to 476 ms) outgrow the lan election's 0.4 s lease
    ("worldwide", True, "test", ["--plane-profile", "test", "--election-profile", "wan"]),
    ("worldwide", False, "test", ["--plane-profile", "test"]),
    ("datacenter", True, "test", ["--plane-profile", "test"]),
    ("universities", True, "lan", ["--plane-profile", "lan"]),
    ("worldwide", True, "wan", ["--plane-profile", "wan"]),
])
def test_peers_run_the_plane_profile_with_an_election_that_fits_the_links(scenario, emulated, profile, flags):
    state = SwarmState(scenario=scenario, scenario_name=scenario, time_scale=1.0, bandwidth_scale=0.05,
                       emulated=emulated, plane_profile=profile)
    assert plane_flags(state) == flags
    assert gossip_profile(state) == ("wan" if scenario == "worldwide" and emulated else "lan")


def test_up_runs_the_test_plane_profile_unless_told():
    assert swarm.build_parser().parse_args(["up"]).plane_profile == "test"
    assert swarm.build_parser().parse_args(["up", "--plane-profile", "wan"]).plane_profile == "wan"


# ---- the run dir against other local users

def test_up_creates_a_private_run_dir_and_key(tmp_path):
    run_dir = tmp_path / "a" / "run"
    ensure_run_dir(run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    write_secret_file(run_dir / KEY_FILE, b"secret\n")
    st = (run_dir / KEY_FILE).stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and (run_dir / KEY_FILE).read_bytes() == b"secret\n"
    ensure_run_dir(run_dir)  # its own dir, private: taken again
    write_secret_file(run_dir / KEY_FILE, b"newer\n")  # a stale key is replaced
    assert (run_dir / KEY_FILE).read_bytes() == b"newer\n"


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o777, 0o701])
def test_a_run_dir_open_to_others_is_refused(tmp_path, mode, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, mode)
    with pytest.raises(SwarmError, match=f"run dir {run_dir} has mode {mode:04o}: other users can enter it; `chmod 700"):
        ensure_run_dir(run_dir)
    with pytest.raises(SwarmError, match="has mode"):
        load_state(run_dir)
    assert swarm.main(["up", "--run-dir", str(run_dir), "--peers", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dtfm-swarm: error: run dir {run_dir} has mode") and err.count("\n") == 1
    assert list(run_dir.iterdir()) == []  # no key written into it


def test_a_run_dir_of_another_user_is_refused(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    state = make_state(tmp_path)
    save_state(run_dir, state)
    planted_uid = os.getuid() + 1  # we are someone else than the dir's owner
    monkeypatch.setattr(os, "getuid", lambda: planted_uid)
    with pytest.raises(SwarmError, match=f"run dir {run_dir} belongs to another user \\(uid {planted_uid - 1}\\)"):
        ensure_run_dir(run_dir)
    with pytest.raises(SwarmError, match="belongs to another user"):
        load_state(run_dir)  # its PIDs are not signalled
    for command in (["up", "--peers", "2"], ["down"], ["status"]):
        assert swarm.main([command[0], "--run-dir", str(run_dir), *command[1:]]) == 1
        assert "belongs to another user" in capsys.readouterr().err
    assert not (run_dir / KEY_FILE).exists()


def test_a_symlinked_run_dir_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "run"
    link.symlink_to(target)
    with pytest.raises(SwarmError, match="is a symbolic link"):
        ensure_run_dir(link)


def test_a_planted_key_link_is_replaced_not_followed(tmp_path):
    run_dir = tmp_path / "run"
    ensure_run_dir(run_dir)
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    (run_dir / KEY_FILE).symlink_to(victim)
    write_secret_file(run_dir / KEY_FILE, b"secret\n")
    assert victim.read_bytes() == b"untouched"
    key = run_dir / KEY_FILE
    assert not key.is_symlink() and key.read_bytes() == b"secret\n"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    # a dangling link (to where the attacker would read it) is not followed either
    key.unlink()
    (run_dir / KEY_FILE).symlink_to(tmp_path / "drop")
    write_secret_file(run_dir / KEY_FILE, b"secret\n")
    assert not (tmp_path / "drop").exists() and key.read_bytes() == b"secret\n"


def test_a_planted_key_file_is_replaced_with_a_private_one(tmp_path):
    run_dir = tmp_path / "run"
    ensure_run_dir(run_dir)
    planted = run_dir / KEY_FILE
    planted.write_bytes(b"")
    os.chmod(planted, 0o666)
    held = open(planted, "rb")  # the planter keeps a descriptor: it must not see the key
    try:
        write_secret_file(planted, b"secret\n")
        assert held.read() == b""
    finally:
        held.close()
    assert stat.S_IMODE(planted.stat().st_mode) == 0o600 and planted.read_bytes() == b"secret\n"


def test_default_run_dir_is_per_user_never_the_shared_temp_dir(tmp_path, monkeypatch):
    runtime = Path(tempfile.mkdtemp(prefix="rt-"))  # short: the peers' sockets live below it
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        assert default_run_dir() == runtime / "dtfm-swarm"
    finally:
        runtime.rmdir()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_run_dir() == tmp_path / "home" / ".cache" / "dtfm" / "swarm"
    assert not str(default_run_dir()).startswith(tempfile.gettempdir() + os.sep + "dtfm")
