"""`dtfm-peer` in process: subcommands, exit codes, error messages, output formats, logging."""

import io
import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
import trio

from dtfm.net import KeyFileError, OperatorKey, load_swarm_operators, operator_line
from dtfm.net.identity import parse_swarm_key
from dtfm.peer import logs
from dtfm.peer.cli import build_parser, main, user_error_text
from dtfm.peer.config import ConfigError, SocketConfig
from dtfm.peer.members import format_members, member_rows
from dtfm.peer.socket import ControlServer
from dtfm.peer.paths import DataDir
from dtfm.peer.status import format_duration, format_text
from paths import ROOT


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def test_swarm_key_new_prints_a_fresh_key(capsys):
    assert main(["swarm-key", "new"]) == 0
    first = capsys.readouterr().out
    assert main(["swarm-key", "new"]) == 0
    second = capsys.readouterr().out
    assert len(parse_swarm_key(first)) == 32
    assert first != second
    assert first.count("\n") == 1


def test_swarm_key_out_is_private_and_never_overwritten(tmp_path, capsys):
    out = tmp_path / "swarm.key"
    assert main(["swarm-key", "new", "--out", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    key = out.read_text()
    assert main(["swarm-key", "new", "--out", str(out)]) == 1
    assert "exists; not overwriting" in capsys.readouterr().err
    assert out.read_text() == key


def test_keygen_creates_once_and_reports_the_id(tmp_path, capsys):
    data_dir = tmp_path / "d"
    assert main(["keygen", "--data-dir", str(data_dir)]) == 0
    captured = capsys.readouterr()
    peer_id = captured.out.strip()
    assert len(bytes.fromhex(peer_id)) == 32
    assert "created a new identity" in captured.err
    assert (data_dir / "identity.key").stat().st_mode & 0o777 == 0o600
    assert data_dir.stat().st_mode & 0o777 == 0o700
    assert main(["keygen", "--data-dir", str(data_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info == {"peer_id": peer_id, "short_id": peer_id[:8], "created": False,
                    "data_dir": str(data_dir)}


@pytest.mark.parametrize("command", ["status", "leave"])
def test_no_daemon_gives_the_clear_error(tmp_path, capsys, command):
    assert main([command, "--data-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"dtfm-peer: error: no daemon is running for data dir {tmp_path}: "
                            "start one with `dtfm-peer join`\n")


def test_status_finds_the_data_dir_in_the_config_file(tmp_path, capsys):
    (tmp_path / "peer.toml").write_text('[peer]\ndata_dir = "d"\n')
    assert main(["status", "--config", str(tmp_path / "peer.toml")]) == 1
    assert f"for data dir {tmp_path / 'd'}:" in capsys.readouterr().err
    assert main(["status", "--config", str(tmp_path / "peer.toml"), "--data-dir",
                 str(tmp_path / "e")]) == 1
    assert f"for data dir {tmp_path / 'e'}:" in capsys.readouterr().err


def test_join_errors_are_one_line(tmp_path, capsys, restore_logging):
    assert main(["join", "--data-dir", str(tmp_path)]) == 1
    assert "joining needs the swarm key: pass --swarm-key FILE" in capsys.readouterr().err
    assert main(["join", "--data-dir", str(tmp_path), "--swarm-key",
                 str(tmp_path / "absent.key")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dtfm-peer: error: no swarm key file at")
    assert err.count("\n") == 1
    (tmp_path / "bad.toml").write_text("[peer]\nlisten = 'x'\n")
    assert main(["join", "--config", str(tmp_path / "bad.toml")]) == 1
    assert "peer.listen: 'x': expected HOST:PORT" in capsys.readouterr().err
    # A value the emulator's own config refuses, given as a flag: a bad command line (exit 2).
    with pytest.raises(SystemExit) as info:
        main(["join", "--data-dir", str(tmp_path), "--drop", "2"])
    assert info.value.code == 2
    assert capsys.readouterr().err.endswith("dtfm-peer join: error: emulation.drop_fraction: drop_fraction must "
                                            "be in [0, 1], got 2.0\n")
    # A data path that does not exist stops `join` before anything starts (no key is needed yet).
    with pytest.raises(SystemExit) as info:
        main(["join", "--data-dir", str(tmp_path), "--data", "/nonexistent"])
    assert info.value.code == 2
    assert capsys.readouterr().err.endswith("dtfm-peer join: error: plane.data (--data) /nonexistent: no such "
                                            "file or folder; give the text file or folder of text files this "
                                            "peer trains on\n")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    for bad, words in (("zip", "unknown compression preset 'zip'"), ("diloco,inner_steps=x", "inner_steps"),
                       ("pp-int4,pp_block_elems=3", "pp_block_elems")):
        with pytest.raises(SystemExit) as info:
            main(["train", "start", "--compress", bad])
        assert info.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["join", "--listen"])
    assert info.value.code == 2


def test_help_explains_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("keygen", "swarm-key", "join", "status", "leave"):
        assert command in out
    parser = build_parser()
    assert parser.prog == "dtfm-peer"


def test_user_errors_are_found_inside_exception_groups():
    err = ConfigError("bad")
    assert user_error_text(err) == "bad"
    assert user_error_text(ExceptionGroup("g", [ExceptionGroup("h", [err])])) == "bad"
    assert user_error_text(ExceptionGroup("g", [err, ConfigError("two")])) is None
    assert user_error_text(RuntimeError("bug")) is None


REPORT = {
    "peer_id": "ab" * 32, "short_id": "abababab", "listen": "127.0.0.1:7450", "region": "eu",
    "pid": 1, "data_dir": "/d", "uptime_s": 125.0,
    "peers": [{"peer_id": "cd" * 32, "short_id": "cdcdcdcd", "address": "10.0.0.2:7450",
               "region": "us", "last_seen_s_ago": 0.25, "connected_for_s": 3700.0}],
    "departed": [{"peer_id": "ef" * 32, "short_id": "efefefef", "address": "10.0.0.3:7450",
                  "region": "", "left_s_ago": 12.0, "reason": "received SIGTERM"}],
    "role": {"stage": 1, "step": 42},
}


def test_status_text_layout():
    text = format_text(REPORT)
    lines = text.splitlines()
    assert lines[0] == f"peer      abababab  ({'ab' * 32})"
    assert "uptime    2m 05s" in lines
    assert "peers     1 connected" in lines
    assert "  cdcdcdcd  10.0.0.2:7450  us      0.2s ago   1h 01m" in lines
    assert "  efefefef  10.0.0.3:7450  -       12s ago  received SIGTERM" in lines
    assert lines[-1] == 'role      {"stage": 1, "step": 42}'


@pytest.mark.parametrize("seconds,text", [(0.04, "0.0s"), (9.95, "9.9s"), (59, "59s"),
                                          (61, "1m 01s"), (7200, "2h 00m"), (90000, "1d 01h"),
                                          (-3, "0.0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


async def test_status_command_against_a_control_server(capsys):
    with tempfile.TemporaryDirectory(prefix="dtfm-cli-", dir="/tmp") as d:
        data_dir = DataDir(Path(d))
        data_dir.ensure()
        server = ControlServer(data_dir.control_socket, SocketConfig())

        async def status(args):
            return REPORT

        server.register("status", status)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            text_rc = await trio.to_thread.run_sync(main, ["status", "--data-dir", d])
            text = capsys.readouterr().out
            json_rc = await trio.to_thread.run_sync(main, ["status", "--json", "--data-dir", d])
            as_json = capsys.readouterr().out
            leave_rc = await trio.to_thread.run_sync(main, ["leave", "--data-dir", d])
            leave_err = capsys.readouterr().err
            nursery.cancel_scope.cancel()
    assert (text_rc, json_rc) == (0, 0)
    assert text == format_text(REPORT) + "\n"
    assert json.loads(as_json) == REPORT
    assert leave_rc == 1
    assert "unknown command 'leave'" in leave_err


def log_line(formatter, msg, *args, exc=None, **extra):
    record = logging.LogRecord("dtfm.peer.daemon", logging.INFO if exc is None else logging.ERROR,
                               __file__, 1, msg, args, exc)
    for k, v in extra.items():
        setattr(record, k, v)
    return formatter.format(record)


def test_human_log_lines_are_single_lines_with_extras():
    line = log_line(logs.HumanFormatter(), "peer %s said %r", "ab12", "two\nlines", peer="ab12")
    assert "\n" not in line
    assert line.endswith("INFO  dtfm.peer.daemon: peer ab12 said 'two\\nlines' peer=ab12")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        import sys
        line = log_line(logs.HumanFormatter(), "failed", exc=sys.exc_info())
    assert "\n" not in line
    assert "(ValueError: bad\\nthing)" in line and "traceback=" in line


def test_json_log_lines_parse_and_carry_extras():
    line = log_line(logs.JsonFormatter(), "peer %s joined", "ab12", peer="ab12")
    obj = json.loads(line)
    assert obj["msg"] == "peer ab12 joined"
    assert obj["level"] == "info" and obj["logger"] == "dtfm.peer.daemon"
    assert obj["peer"] == "ab12"
    assert obj["ts"].endswith("Z")


def test_configure_replaces_its_own_handler(restore_logging):
    stream = io.StringIO()
    logs.configure("warning", json_lines=True, stream=stream)
    logs.configure("info", json_lines=True, stream=stream)
    logging.getLogger("dtfm.test").info("once")
    logging.getLogger("dtfm.test").debug("hidden")
    lines = stream.getvalue().splitlines()
    assert [json.loads(x)["msg"] for x in lines] == ["once"]


def test_a_log_file_is_rotated_by_size_and_keeps_its_backups(tmp_path, restore_logging):
    """`join --log-file`: past max_bytes the file becomes FILE.1 (FILE.1 becomes FILE.2, ...),
    the oldest past `backups` deleted: the logs take at most (backups + 1) x max_bytes."""
    path = tmp_path / "daemon.log"
    handler = logs.configure("info", file=path, max_bytes=2_000, backups=2)
    try:
        for k in range(200):
            logging.getLogger("dtfm.test").info("line %d of the soak", k)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.log", "daemon.log.1", "daemon.log.2"]
    assert all(p.stat().st_size <= 2_000 for p in tmp_path.iterdir())
    assert "line 199 of the soak" in path.read_text().splitlines()[-1]
    newest_backup = (tmp_path / "daemon.log.1").read_text().splitlines()
    assert int(newest_backup[-1].split("line ")[1].split()[0]) + 1 == int(path.read_text().split("line ")[1].split()[0])


def test_join_with_a_log_file_it_cannot_open_exits_2_naming_it(tmp_path, capsys, restore_logging):
    with pytest.raises(SystemExit) as e:
        main(["join", "--data-dir", str(tmp_path / "d"), "--log-file", str(tmp_path / "no" / "such" / "dir.log")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--log-file {tmp_path / 'no' / 'such' / 'dir.log'}: cannot open it: No such file or directory" in err


def test_python_m_entry_point_exists():
    import importlib.util
    assert importlib.util.find_spec("dtfm.peer.__main__") is not None
    assert os.access(ROOT / "peer" / "__main__.py", os.R_OK)


def test_swarm_key_out_is_0600_under_any_umask_and_force_replaces(tmp_path, capsys):
    out = tmp_path / "swarm.key"
    old = os.umask(0)
    try:
        assert main(["swarm-key", "new", "--out", str(out)]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o600
    key = out.read_text()
    assert main(["swarm-key", "new", "--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    out.chmod(0o644)
    assert main(["swarm-key", "new", "--out", str(out), "--force"]) == 0
    assert out.read_text() != key and len(parse_swarm_key(out.read_text())) == 32
    assert out.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swarm.key", "swarm.key.operator"]   # no temporary left


def test_a_swarm_key_names_the_operator_key_made_beside_it(tmp_path, capsys):
    # `swarm-key new --out FILE` also makes FILE.operator (0600, whatever the umask) and names its
    # public key in FILE, so `join --swarm-key FILE` learns the operator and `train` signs with it.
    out = tmp_path / "swarm.key"
    old = os.umask(0)
    try:
        assert main(["swarm-key", "new", "--out", str(out)]) == 0
    finally:
        os.umask(old)
    op_file = tmp_path / "swarm.key.operator"
    assert op_file.stat().st_mode & 0o777 == 0o600
    key = OperatorKey.load(op_file)
    assert load_swarm_operators(out) == (key.public_key,)
    # another operator: its own key, and a line to add to the swarm key file
    other = tmp_path / "bob.operator"
    capsys.readouterr()
    assert main(["operator-key", "new", "--out", str(other)]) == 0
    line = capsys.readouterr().out.strip()
    assert line == operator_line(OperatorKey.load(other).public_key)
    assert main(["operator-key", "new", "--out", str(other)]) == 1  # never over an existing key
    assert "--force" in capsys.readouterr().err
    out.write_text(out.read_text() + line + "\n")
    assert load_swarm_operators(out) == (key.public_key, OperatorKey.load(other).public_key)
    out.write_text(out.read_text() + "dtfm-operator-v1:zz\n")
    with pytest.raises(KeyFileError, match="line 4"):
        load_swarm_operators(out)


def test_an_operator_key_readable_by_others_or_garbled_is_refused(tmp_path):
    path = tmp_path / "op"
    key = OperatorKey.create(path)
    assert OperatorKey.load(path).public_key == key.public_key
    for mode in (0o640, 0o604):
        path.chmod(mode)
        with pytest.raises(KeyFileError, match=f"mode {mode:04o}: other users may read it"):
            OperatorKey.load(path)
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match="exists"):
        OperatorKey.create(path)
    path.write_text("dtfm-operator-key-v1:1234\n")
    with pytest.raises(KeyFileError, match="garbled"):
        OperatorKey.load(path)
    with pytest.raises(KeyFileError, match="no operator key at .*--operator-key"):
        OperatorKey.load(tmp_path / "absent")
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        OperatorKey.load(tmp_path / "link")


def test_a_swarm_key_readable_by_others_is_warned_about(tmp_path, caplog):
    import dataclasses

    from dtfm.peer.config import DaemonConfig
    from dtfm.peer.runner import build_daemon

    key = tmp_path / "swarm.key"
    assert main(["swarm-key", "new", "--out", str(key)]) == 0
    config = DaemonConfig.test()
    config = dataclasses.replace(config, peer=dataclasses.replace(config.peer, swarm_key_file=key))
    data_dir = DataDir(tmp_path / "d")
    data_dir.ensure()
    with caplog.at_level(logging.WARNING, logger="dtfm.peer.runner"):
        build_daemon(config, data_dir)
        assert caplog.records == []
        key.chmod(0o640)
        build_daemon(config, data_dir)
    [record] = caplog.records
    assert str(key) in record.getMessage() and f"chmod 600 {key}" in record.getMessage()


@pytest.mark.parametrize("asked, last, want, error", [
    (None, "ab" * 16, "ab" * 16, None),  # the swarm's last run
    ("abab", "ab" * 16, "ab" * 16, None),  # a prefix of it
    ("ABAB", "ab" * 16, "ab" * 16, None),
    ("cd" * 16, "ab" * 16, "cd" * 16, None),  # a full id: the coordinator says whether it knows it
    (None, None, None, "knows no run to resume"),
    ("cdcd", "ab" * 16, None, "unknown run 'cdcd': this peer's last run is abababab"),
    ("zz", None, None, "unknown run 'zz'"),
])
def test_train_resume_names_the_run(asked, last, want, error):
    from dtfm.peer.cli import CliError, resume_run_id
    if error is None:
        assert resume_run_id(asked, {"last_run_id": last}) == bytes.fromhex(want)
    else:
        with pytest.raises(CliError, match=error):
            resume_run_id(asked, {"last_run_id": last})


RUN_HEX = "ab" * 16
COORD_HEX = "cd" * 32


def progress(state: str, completed: int, steps_after: int, *, reconfigs=(), eta=None) -> dict:
    lines = [{"step": s, "loss": 5.0 - s / 10, "epoch": 2 if s >= 3 else 1, "iteration_s": 0.5,
              "tokens_per_s": 2048.0} for s in range(steps_after + 1, completed)]
    return {"run": RUN_HEX, "coordinator": COORD_HEX, "state": state, "term": 2, "epoch": 2, "shape": "2x1",
            "completed": completed, "steps": 6, "lines": lines, "reconfigurations": list(reconfigs),
            "tokens_per_s": 2048.0, "eta_s": eta, "reason": ""}


async def test_train_status_follows_the_run_until_it_ends(capsys, monkeypatch):
    # The daemon's answers as the coordinator gives them: the first with steps 0-2, then a
    # reconfiguration and steps 3-4, then the finished run. The CLI asks each time only for the
    # steps after the last one it printed, prints each step once with the ETA, the
    # reconfiguration once, and returns 0 at the end; without --follow it prints one answer.
    import dtfm.peer.follow as follow_module
    monkeypatch.setattr(follow_module, "FOLLOW_POLL_S", 0.0)
    reconfig = {"at": 1.7e9, "epoch": 2, "kind": "shrink", "old_shape": "2x2", "new_shape": "2x1",
                "resume_step": 3, "rollback": False, "reason": "peer 1a2b3c4d is dead"}
    answers = [progress("training", 3, -1, eta=1.5), progress("training", 5, 2, reconfigs=[reconfig], eta=0.5),
               progress("finished", 6, 4, reconfigs=[reconfig])]
    asked: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="dtfm-cli-", dir="/tmp") as d:
        data_dir = DataDir(Path(d))
        data_dir.ensure()
        server = ControlServer(data_dir.control_socket, SocketConfig())

        async def train_status(args):
            asked.append(args)
            return answers[min(len(asked), len(answers)) - 1]

        server.register("train_status", train_status)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            rc = await trio.to_thread.run_sync(main, ["train", "status", "--follow", "--data-dir", d])
            followed = capsys.readouterr().out.splitlines()
            asked_once = len(asked)
            once_rc = await trio.to_thread.run_sync(main, ["train", "status", RUN_HEX, "--data-dir", d])
            once = capsys.readouterr().out.splitlines()
            nursery.cancel_scope.cancel()
    assert rc == 0 and asked[:asked_once] == [{"run": None, "after": -1}, {"run": RUN_HEX, "after": 2},
                                              {"run": RUN_HEX, "after": 4}]
    assert followed == [
        f"run {RUN_HEX[:8]}: training, term 2, epoch 2, 2x1 (stages x pipelines), 3 of 6 steps, last step 2048 tokens/s, "
        f"ETA 1.5s, coordinator {COORD_HEX[:8]}",
        "step 1/6  loss 5.0000  0.50 s  2048 tokens/s  epoch 1  ETA 1.5s",
        "step 2/6  loss 4.9000  0.50 s  2048 tokens/s  epoch 1  ETA 1.5s",
        "step 3/6  loss 4.8000  0.50 s  2048 tokens/s  epoch 1  ETA 1.5s",
        "reconfigured (epoch 2, shrink): 2x2 -> 2x1, resumed after step 3: peer 1a2b3c4d is dead",
        "step 4/6  loss 4.7000  0.50 s  2048 tokens/s  epoch 2  ETA 0.5s",
        "step 5/6  loss 4.6000  0.50 s  2048 tokens/s  epoch 2  ETA 0.5s",
        "step 6/6  loss 4.5000  0.50 s  2048 tokens/s  epoch 2",
        f"run {RUN_HEX[:8]} finished: all 6 steps",
    ]
    assert once_rc == 0 and asked[asked_once] == {"run": RUN_HEX, "after": -1}
    assert once[0].startswith(f"run {RUN_HEX[:8]}: finished, term 2") and len(once) == 3  # its last answer
    with pytest.raises(SystemExit) as e:
        main(["train", "status", "nope"])
    assert e.value.code == 2 and "must be a run id of 32 hex digits" in capsys.readouterr().err



def test_follow_json_is_one_json_object_on_every_line():
    # Operator review M2: the header and the end of `train status --follow --json` were text, so a
    # script reading JSON lines broke on line 1.
    from dtfm.peer.follow import follow

    reconfig = {"at": 1.7e9, "epoch": 2, "kind": "shrink", "old_shape": "2x2", "new_shape": "2x1",
                "resume_step": 3, "rollback": False, "reason": "peer 1a2b3c4d is dead"}
    answers = iter([progress("training", 3, -1, eta=1.5), progress("training", 5, 2, reconfigs=[reconfig]),
                    progress("finished", 6, 4, reconfigs=[reconfig])])
    out = io.StringIO()
    assert follow(lambda args: next(answers), out, keep_following=True, as_json=True, sleep=lambda s: None) == 0
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["record"] for r in records] == ["run", "step", "step", "step", "reconfiguration", "step", "step",
                                              "step", "end"]
    assert records[0] == {"record": "run", "run": RUN_HEX, "coordinator": COORD_HEX, "state": "training", "term": 2,
                          "epoch": 2, "shape": "2x1", "completed": 3, "steps": 6, "tokens_per_s": 2048.0,
                          "eta_s": 1.5, "reason": ""}
    assert [r["step"] for r in records if r["record"] == "step"] == [0, 1, 2, 3, 4, 5]
    assert records[4] == {"record": "reconfiguration", **reconfig}
    assert records[-1] == {"record": "end", "run": RUN_HEX, "state": "finished", "completed": 6, "steps": 6,
                           "reason": ""}
    # without --follow: the one answer as the daemon gave it
    out = io.StringIO()
    assert follow(lambda args: progress("training", 3, -1), out, as_json=True) == 0
    assert json.loads(out.getvalue()) == progress("training", 3, -1)

# ---- dtfm-peer members ------------------------------------------------------------------------

A, B, C, D, E = ("a1" * 32, "b2" * 32, "c3" * 32, "d4" * 32, "e5" * 32)
SWARM_REPORT = {
    **REPORT, "peer_id": B, "short_id": B[:8],
    "gossip": {"counts": {"alive": 3, "suspect": 1, "unconfirmed": 0, "dead": 0, "left": 1, "total": 5},
               "members": [
                   {"id": A, "short_id": A[:8], "region": "eu", "address": "10.0.0.1:7450", "state": "alive"},
                   {"id": B, "short_id": B[:8], "region": "us", "address": "10.0.0.2:7450", "state": "alive"},
                   {"id": C, "short_id": C[:8], "region": "asia", "address": "10.0.0.3:7450", "state": "alive"},
                   {"id": D, "short_id": D[:8], "region": "eu", "address": "10.0.0.4:7450", "state": "suspect"},
                   {"id": E, "short_id": E[:8], "region": "us", "address": "10.0.0.5:7450", "state": "left"}],
               "truncated": []},
    "training": {"state": "training", "coordinator": A, "run_id": "f0" * 16, "epoch": 3, "stages": 2, "dp": 1,
                 "pipelines": [[B, C]], "layer_ranges": [[0, 2], [2, 4]], "spares": [D], "voters": [A, B, C]},
}


def test_members_joins_gossips_table_with_the_roles_in_the_applied_allocation():
    rows = {r["short_id"]: r for r in member_rows(SWARM_REPORT)}
    assert [(r["roles"], r["stage"], r["pipeline"], r["state"]) for r in rows.values()] == [
        (["coordinator", "voter"], None, None, "alive"),
        (["voter", "stage"], 0, 0, "alive"),
        (["voter", "stage"], 1, 0, "alive"),
        (["spare"], None, None, "suspect"),
        ([], None, None, "left")]
    assert rows[C[:8]]["layers"] == [2, 4] and rows[B[:8]]["me"] and not rows[A[:8]]["me"]
    text = format_members(list(rows.values()), SWARM_REPORT).splitlines()
    assert text[0] == "5 members: 3 alive, 1 suspect, 1 left; run f0f0f0f0 epoch 3, 2 stages x 1 pipeline"
    assert text[1].split() == ["PEER", "ROLE", "STAGE", "PIPELINE", "REGION", "ADDRESS", "STATE"]
    assert text[3].split() == [B[:8], "*", "voter,stage", "0", "0", "us", "10.0.0.2:7450", "alive"]
    assert text[6].split() == [E[:8], "-", "-", "-", "us", "10.0.0.5:7450", "left"]


def test_members_of_a_daemon_without_a_run_or_gossip_lists_itself():
    rows = member_rows(REPORT)
    assert [(r["short_id"], r["roles"], r["state"], r["me"]) for r in rows] == [("abababab", [], "alive", True)]
    text = format_members(rows, REPORT).splitlines()
    assert text[-1].startswith("(this daemon has applied no allocation, so it knows no stages or spares")


def test_members_says_when_the_run_is_over():
    report = {**SWARM_REPORT, "training": {**SWARM_REPORT["training"], "state": "finished", "stages": 1}}
    head = format_members(member_rows(report), report).splitlines()[0]
    assert head.endswith("; run f0f0f0f0 (finished) epoch 3, 1 stage x 1 pipeline")


async def test_members_command_against_a_control_server(capsys):
    with tempfile.TemporaryDirectory(prefix="dtfm-cli-", dir="/tmp") as d:
        data_dir = DataDir(Path(d))
        data_dir.ensure()
        server = ControlServer(data_dir.control_socket, SocketConfig())

        async def status(args):
            return SWARM_REPORT

        server.register("status", status)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            text_rc = await trio.to_thread.run_sync(main, ["members", "--data-dir", d])
            text = capsys.readouterr().out
            json_rc = await trio.to_thread.run_sync(main, ["members", "--json", "--data-dir", d])
            as_json = json.loads(capsys.readouterr().out)
            nursery.cancel_scope.cancel()
    assert (text_rc, json_rc) == (0, 0)
    assert text.startswith("5 members: 3 alive, 1 suspect, 1 left")
    assert as_json["coordinator"] == A and as_json["run_id"] == "f0" * 16 and not as_json["truncated"]
    assert [(m["id"], m["roles"], m["state"]) for m in as_json["members"]][:2] == [
        (A, ["coordinator", "voter"], "alive"), (B, ["voter", "stage"], "alive")]


def stopped_progress(completed: int, after: int, stop_step: int | None) -> dict:
    lines = [{"step": s, "loss": 3.0, "epoch": 3, "iteration_s": 0.2, "tokens_per_s": 9000.0}
             for s in range(after + 1, completed)]
    return {"run": RUN_HEX, "coordinator": COORD_HEX, "state": "stopped" if stop_step else "training", "term": 1,
            "epoch": 3, "shape": "1x2", "completed": completed, "steps": 300, "lines": lines, "reconfigurations": [],
            "tokens_per_s": 9000.0, "eta_s": None, "stop_step": stop_step,
            "reason": f"an operator stopped the run after step {stop_step} (train stop)" if stop_step else ""}


def test_follow_prints_the_steps_up_to_an_operators_stop_before_it_ends():
    # The walkthrough's stop: taken when 68 steps were done, at the boundary after step 70. The
    # coordinator says `stopped` at once while the peers still run steps 69 and 70; --follow
    # printed `stopped after 68 of 300 steps: ... after step 70` and left. It now waits for them.
    import io

    from dtfm.peer.follow import follow
    answers = iter([stopped_progress(66, -1, None), stopped_progress(68, 65, 70), stopped_progress(68, 67, 70),
                    stopped_progress(70, 67, 70)])
    out = io.StringIO()
    assert follow(lambda args: next(answers), out, keep_following=True, sleep=lambda s: None) == 0
    lines = out.getvalue().splitlines()
    assert [x.split()[1] for x in lines if x.startswith("step ")][-3:] == ["68/300", "69/300", "70/300"]
    assert lines[-1] == (f"run {RUN_HEX[:8]} stopped after 70 of 300 steps: an operator stopped the run after "
                         "step 70 (train stop)")


def test_follow_ends_when_the_steps_up_to_a_stop_never_come(monkeypatch):
    # A peer lost after the stop: the run ends short of the boundary; --follow gives up after
    # STOP_WAIT_POLLS polls without a new step.
    import io

    import dtfm.peer.follow as follow_module
    monkeypatch.setattr(follow_module, "STOP_WAIT_POLLS", 3)
    asked: list[dict] = []

    def request(args):
        asked.append(args)
        return stopped_progress(66, -1, None) if len(asked) == 1 else stopped_progress(68, args["after"], 70)

    out = io.StringIO()
    assert follow_module.follow(request, out, keep_following=True, sleep=lambda s: None) == 0
    assert len(asked) == 5  # the first answer, the one with steps 67-68, then 3 without a new step
    assert out.getvalue().splitlines()[-1].startswith(f"run {RUN_HEX[:8]} stopped after 68 of 300 steps")


# ---- dtfm-peer train stop ---------------------------------------------------------------------

async def test_train_stop_answers_on_stdout_and_takes_json_and_timeout_like_the_others(capsys):
    # Operator review L9: `train stop` had no --json and no --timeout, and its one line went to stderr.
    with tempfile.TemporaryDirectory(prefix="dtfm-cli-", dir="/tmp") as d:
        data_dir = DataDir(Path(d))
        data_dir.ensure()
        key_file = Path(d) / "swarm.key"
        operator = OperatorKey.create(Path(d) / "swarm.key.operator")
        server = ControlServer(data_dir.control_socket, SocketConfig())
        stops: list[dict] = []

        async def train_info(args):
            return {"run_id": RUN_HEX, "swarm_key_file": str(key_file), "operators": [operator.public_key.hex()]}

        async def train_stop(args):
            stops.append(args)
            return {"at_step": 70, "told": 3}

        server.register("train_info", train_info)
        server.register("train_stop", train_stop)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            text_rc = await trio.to_thread.run_sync(main, ["train", "stop", "--data-dir", d])
            text = capsys.readouterr()
            json_rc = await trio.to_thread.run_sync(main, ["train", "stop", "--json", "--timeout", "5",
                                                           "--data-dir", d])
            as_json = json.loads(capsys.readouterr().out)
            nursery.cancel_scope.cancel()
    assert (text_rc, json_rc) == (0, 0)
    assert text.out == "the run stops after step 70 (3 peers told)\n" and text.err == ""
    assert as_json == {"at_step": 70, "told": 3}
    assert len(stops) == 2 and set(stops[0]["op"]) == {"body", "sig"}  # a signed operation
    args = build_parser().parse_args(["train", "stop"])
    assert (args.timeout, args.json) == (60.0, False)
    assert build_parser().parse_args(["train", "stop", "--timeout", "5", "--json"]).timeout == 5.0
    from dtfm.peer.cli import format_stopped
    assert format_stopped({"at_step": 0, "told": 1}) == "the run stops before its first step (1 peer told)"


async def test_train_resume_says_where_it_resumes_once(capsys):
    # Operator review C1: "run 1b78ee43 resumes after step 117: reschedule, ..., epoch 4, resumed
    # after step 117, train resume" said the step and the command twice.
    with tempfile.TemporaryDirectory(prefix="dtfm-cli-", dir="/tmp") as d:
        data_dir = DataDir(Path(d))
        data_dir.ensure()
        operator = OperatorKey.create(Path(d) / "swarm.key.operator")
        server = ControlServer(data_dir.control_socket, SocketConfig())

        async def train_info(args):
            return {"last_run_id": RUN_HEX, "swarm_key_file": str(Path(d) / "swarm.key"),
                    "operators": [operator.public_key.hex()]}

        async def train_resume(args):
            return {"kind": "reschedule", "old_shape": "1x2", "new_shape": "1x2", "moves": 0, "bytes_moved": 0,
                    "predicted_old_s": 0.044, "predicted_new_s": 0.044, "epoch": 4, "resume_step": 117,
                    "reason": "train resume"}

        server.register("train_info", train_info)
        server.register("train_resume", train_resume)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            rc = await trio.to_thread.run_sync(main, ["train", "resume", "--data-dir", d])
            out = capsys.readouterr().out
            nursery.cancel_scope.cancel()
    assert rc == 0
    assert out == (f"run {RUN_HEX[:8]} resumes after step 117: reschedule, 1x2 -> 1x2, 0 moves, 0 B moved, "
                   "predicted 0.044 s -> 0.044 s per step, epoch 4\n")


def test_the_start_line_says_what_its_prediction_rests_on():
    # Operator review M3: the predicted time per step was 5-50x below the measured one on a loaded
    # machine, printed with no word of what it rests on.
    from dtfm.peer.cli import format_started
    line = format_started("tiny", {"steps": 100, "stages": 1, "dp": 3, "predicted_iteration_s": 0.061})
    assert line == ("training tiny for 100 steps as 1 stage x 3 pipelines; predicted 0.061 s per step (from each "
                    "peer's speed measured on its own: slower where peers share cores or a machine is busy)")
