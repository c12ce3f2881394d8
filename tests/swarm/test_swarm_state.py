"""dtfm-swarm's pure parts: run-dir state, peer lookup, the measured view in scenario units,
the command line."""

import argparse
import json
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
    STATE_FILE,
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


def test_a_state_of_another_version_is_refused_with_what_to_do(tmp_path):
    save_state(tmp_path, make_state(tmp_path))
    raw = json.loads((tmp_path / STATE_FILE).read_text())
    for changed in ({**raw, "flux_capacitor": 1}, {**raw, "peers": [{"name": "p00"}]}, {**raw, "version": 0}):
        (tmp_path / STATE_FILE).write_text(json.dumps(changed))
        with pytest.raises(SwarmError, match="written by another version of dtfm-swarm: remove .* and start again"):
            load_state(tmp_path)


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


def test_up_refuses_an_unknown_scenario_before_starting_peers(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert swarm.main(["up", "--run-dir", str(run_dir), "--scenario", "atlantis"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dtfm-swarm: error: ") and "no scenario 'atlantis'" in err and err.count("\n") == 1
    assert not run_dir.exists()


@pytest.mark.parametrize("argv,message", [
    (["up", "--peers", "many"], "argument --peers: must be a peer count from 2 to 256, got 'many'"),
    (["up", "--peers", "0"], "argument --peers: must be a peer count from 2 to 256, got '0'"),
    (["up", "--peers", "1"], "argument --peers: must be a peer count from 2 to 256, got '1'"),
    (["up", "--peers", "257"], "argument --peers: must be a peer count from 2 to 256, got '257'"),
    (["demo", "--peers", "0"], "argument --peers: must be a peer count from 2 to 256, got '0'"),
    (["up", "--time-scale", "0"], "argument --time-scale: must be a positive number, got '0'"),
    (["up", "--bandwidth-scale", "nan"], "argument --bandwidth-scale: must be a positive number, got 'nan'"),
    (["up", "--timeout", "-1"], "argument --timeout: must be a positive number of seconds, got '-1'"),
    (["train", "--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
    (["train", "--stages", "0"], "argument --stages: must be a positive integer, got '0'"),
    (["train", "--checkpoint-every", "-1"], "argument --checkpoint-every: must be a non-negative integer, got '-1'"),
    (["wait", "--step", "-1"], "argument --step: must be a non-negative integer, got '-1'"),
    (["up", "--fresh", "--resume"], "argument --resume: not allowed with argument --fresh"),
    (["up", "--device", "gpu"], "argument --device: choose cpu, cuda or cuda:N, not 'gpu'"),
    (["train", "--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
])
def test_bad_values_exit_2_with_usage_before_anything_starts(tmp_path, capsys, argv, message):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        swarm.main([*argv, "--run-dir", str(run_dir)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dtfm-swarm") and f"error: {message}" in err, err
    assert not run_dir.exists()


def test_every_subcommand_has_a_description():
    parser = swarm.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert p.description and len(p.description) > 40, name
        assert name in parser.format_help()
    assert "RUN_DIR" not in sub.choices["up"].format_help()  # metavars say what to give


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
# ---- the run dir of an earlier swarm ----------------------------------------------------------

def _used_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    state = make_state(run_dir)
    for p in state.peers:
        (run_dir / p.name).mkdir(parents=True)
        (run_dir / p.name / "daemon.log").write_text("old\n")
    save_state(run_dir, state)
    for name in ("swarm.key", "train.jsonl", "report.txt"):
        (run_dir / name).write_text("old\n")
    (run_dir / "notes.txt").write_text("the user's own\n")
    return run_dir


def test_up_refuses_a_used_run_dir_without_fresh_or_resume(tmp_path, capsys, monkeypatch):
    run_dir = _used_run_dir(tmp_path)
    monkeypatch.setattr(swarm, "start_peer", lambda *a: pytest.fail("started a peer"))
    assert swarm.main(["up", "--run-dir", str(run_dir), "--peers", "2"]) == 1
    err = capsys.readouterr().err
    assert (f"dtfm-swarm: error: {run_dir} holds an earlier swarm (swarm.json, swarm.key, train.jsonl, "
            "report.txt, p00, p01, ...): pass --fresh") in err and "--resume" in err
    assert (run_dir / "p00" / "daemon.log").exists() and (run_dir / "train.jsonl").exists()


def test_fresh_deletes_what_the_swarm_wrote_and_nothing_else(tmp_path):
    run_dir = _used_run_dir(tmp_path)
    (run_dir / "p77").mkdir()  # no daemon.log, no identity: not a peer dir
    swarm.reuse_run_dir(run_dir, load_state(run_dir), fresh=True, resume=False)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt", "p77"]
    swarm.reuse_run_dir(run_dir, None, fresh=False, resume=False)  # clean now: nothing to refuse


def test_resume_keeps_the_earlier_swarm(tmp_path, capsys):
    run_dir = _used_run_dir(tmp_path)
    swarm.reuse_run_dir(run_dir, load_state(run_dir), fresh=False, resume=True)
    assert (run_dir / "p00" / "daemon.log").exists()
    assert "resuming in" in capsys.readouterr().err


# ---- signals: `up` stops what it started --------------------------------------------------------

# `dtfm-swarm up` with `sleep` processes for peers: as a daemon, each runs in a session of its own,
# so only `up` itself can stop it. MODE "starting": SIGTERM arrives while `up` waits for the swarm
# to converge; "foreground": `up --foreground` runs until the test sends SIGTERM.
FAKE_UP = r"""
import os, signal, subprocess, sys, time
from dtfm.swarm import cli, proc

run_dir, mode = sys.argv[1], sys.argv[2]

def start_peer(run_dir, state, peer, extra):
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    proc._STARTED[p.pid] = p
    peer.pid = p.pid
    print("pid", p.pid, flush=True)

def wait_converged(state, timeout_s, *, need_measurements):
    if mode == "starting":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

cli.start_peer, cli.wait_converged = start_peer, wait_converged
sys.exit(cli.main(["up", "--run-dir", run_dir, "--scenario", "datacenter", "--peers", "3", "--no-emulation",
                   "--compute-ms", "30"]  # (no probe of the machine: what is tested is the signal)
                  + (["--foreground"] if mode == "foreground" else [])))
"""


@pytest.mark.parametrize("mode", ["starting", "foreground"])
def test_sigterm_to_up_stops_every_peer_it_started(tmp_path, mode):
    import signal
    import subprocess
    import sys
    import time

    from dtfm.swarm.state import pid_alive

    cmd = [sys.executable, "-c", FAKE_UP, str(tmp_path / "run"), mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        if mode == "foreground":
            for line in proc.stderr:  # the peers are up; `up` stays
                if "running in the foreground" in line:
                    break
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        pids = [int(line.split()[1]) for line in out.splitlines() if line.startswith("pid ")]
        assert proc.returncode == 143, err
        assert "dtfm-swarm: terminated" in err
        assert len(pids) == 3
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if pid_alive(p)]
    finally:
        proc.kill()
        proc.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_converging_without_a_terminal_logs_changes_not_every_poll(tmp_path, monkeypatch):
    import io

    from dtfm.swarm import proc

    state = make_state(tmp_path)
    for p in state.peers:
        p.pid = os.getpid()
    n = len(state.peers)
    polls = {p.name: 0 for p in state.peers}

    def peer_status(peer):  # every peer sees all; each poll measures one more link
        polls[peer.name] += 1
        members = [{"id": q.peer_id, "state": "alive"} for q in state.peers]
        return {"peer_id": peer.peer_id, "gossip": {"members": members, "view": {
            "measured_links": min(polls[peer.name], n * (n - 1)), "expected_links": n * (n - 1)}}}

    clock = [0.0]
    monkeypatch.setattr(proc, "peer_status", peer_status)
    monkeypatch.setattr(proc.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(proc.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    out = io.StringIO()  # not a terminal
    proc.wait_converged(state, 60.0, need_measurements=True, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == ("peers answering 3/3, seeing all 3/3, views ready 0/3, links measured 3/18 (each peer's view of the "
                        "6 directed links)")
    assert lines[-1].endswith("views ready 3/3, links measured 18/18 (each peer's view of the 6 directed links)")
    assert len(lines) == 2  # 6 polls of 0.25 s: no periodic line in between


def test_demo_gets_as_far_as_starting_peers(tmp_path, monkeypatch, capsys):
    """`dtfm-swarm demo` (the README's first command) has every setting `up` reads."""
    def start_peer(run_dir, state, peer, extra):
        raise SwarmError(f"would start {peer.name} with the {state.plane_profile} plane profile")

    monkeypatch.setattr(swarm, "start_peer", start_peer)
    assert swarm.main(["demo", "--run-dir", str(tmp_path / "run"), "--peers", "2"]) == 1
    assert "would start p00 with the test plane profile" in capsys.readouterr().err


def test_a_scripted_swarm_admits_all_its_peers_on_loopback_and_no_more_than_it_needs(tmp_path):
    # Every peer of a scripted swarm shares 127.0.0.1, whose cap on gossip members must admit
    # the swarm (64 by default), and grows with it, never past what the swarm needs plus room
    # for joins: an intruder on the machine adds at most that many identities.
    import tomllib

    from dtfm.gossip import GossipConfig
    from dtfm.swarm.proc import loopback_cap, peer_config

    def cap() -> int:
        return tomllib.loads((tmp_path / "peers.toml").read_text())["gossip"]["max_members_per_loopback"]

    peer_config(tmp_path, 8)
    assert cap() == GossipConfig().max_members_per_loopback == 64
    peer_config(tmp_path, 200)
    assert cap() == loopback_cap(200) == 216
    peer_config(tmp_path, 8)  # a smaller swarm later does not shrink it under peers still running
    assert cap() == 216


def test_peers_of_a_gpu_swarm_join_with_its_device(tmp_path, monkeypatch):
    """`up --device cuda` is every peer's `join --device cuda`, and `up --layer-probe off` its
    `join --layer-probe off`, also after a restart (the state keeps them)."""
    from dtfm.swarm import proc

    started: list[list[str]] = []

    class FakeProc:
        pid = 999_999

    monkeypatch.setattr(proc.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or FakeProc())
    monkeypatch.setattr(proc, "_STARTED", {})
    peer = PeerEntry(name="p00", index=0, region="Virginia", port=1, data_dir=str(tmp_path / "p00"))
    for device, probe in (("cuda:1", "off"), ("cpu", "measure")):
        state = SwarmState(scenario="worldwide", scenario_name="worldwide", time_scale=1.0, bandwidth_scale=1.0,
                           peers=[peer], device=device, layer_probe=probe)
        save_state(tmp_path, state)
        proc.start_peer(tmp_path, load_state(tmp_path), peer, [])
    assert started[0][started[0].index("--device") + 1] == "cuda:1" and "--device" not in started[1]
    # (and `up --layer-probe`, kept the same way)
    assert [cmd[cmd.index("--layer-probe") + 1] for cmd in started] == ["off", "measure"]


def test_peer_ports_come_from_below_the_ephemeral_range_and_are_free(tmp_path, monkeypatch):
    """A swarm's listening ports are distinct, bindable and below the kernel's ephemeral range
    (no outgoing connection takes one while its daemon starts); where that range leaves no room,
    any free port the kernel hands out."""
    import socket

    from dtfm.swarm import proc

    low = proc._ephemeral_low()
    ports = proc.free_ports(8)
    assert len(set(ports)) == 8 and all(proc.LISTEN_PORTS_FLOOR <= p < low for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    monkeypatch.setattr(proc, "_EPHEMERAL_RANGE", tmp_path / "range")
    (tmp_path / "range").write_text(f"{proc.LISTEN_PORTS_FLOOR + 8}\t60999\n")  # (no room for 8 below it)
    ports = proc.free_ports(8)
    assert len(set(ports)) == 8 and all(p > 0 for p in ports)
    (tmp_path / "range").write_text("garbage")
    assert proc._ephemeral_low() == 32768
