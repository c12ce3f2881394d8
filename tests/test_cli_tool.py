"""The command-line tools as a user meets them: quick to answer without loading torch,
`--version` everywhere, exit status 2 for every bad value."""

import argparse
import subprocess
import sys

import pytest

from dtfm.peer.cli import build_parser as peer_parser
from dtfm.peer.cli import main as peer_main
from dtfm.sched.cli import main as sched_main
from dtfm.swarm.cli import build_parser as swarm_parser
from dtfm.swarm.cli import main as swarm_main
from dtfm.train.cli import main as train_main

# Import each CLI, build its parser and print its help (as `--help` does), then list which heavy
# modules got loaded. Run in a fresh interpreter: this test process has torch already.
PROBE = r"""
import contextlib, io, sys
from dtfm.peer.cli import build_parser as peer_parser
from dtfm.swarm.cli import build_parser as swarm_parser
from dtfm.swarm.cli import cmd_status
for parser, argv in ((peer_parser(), ["--help"]), (peer_parser(), ["status", "--help"]),
                     (peer_parser(), ["leave", "--help"]), (peer_parser(), ["join", "--help"]),
                     (peer_parser(), ["members", "--help"]),
                     (swarm_parser(), ["--help"]), (swarm_parser(), ["status", "--help"])):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        parser.parse_args(argv)
print(" ".join(m for m in ("torch", "scipy", "matplotlib", "safetensors") if m in sys.modules))
"""


def test_status_leave_and_help_load_no_torch_scipy_or_matplotlib():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


def test_dtfm_peer_status_and_members_without_a_daemon_load_no_torch(tmp_path):
    probe = ("import sys\nfrom dtfm.peer.cli import main\n"
             f"rc = main(['status', '--data-dir', {str(tmp_path)!r}])\n"
             f"rc2 = main(['members', '--data-dir', {str(tmp_path)!r}])\n"
             "print(rc, rc2, 'torch' in sys.modules, 'scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "1", "False", "False"]
    assert "no daemon is running for data dir" in out.stderr


@pytest.mark.parametrize("main,prog", [(peer_main, "dtfm-peer"), (swarm_main, "dtfm-swarm"),
                                       (sched_main, "dtfm-sched"), (train_main, "python -m dtfm.train")])
def test_version_on_every_command(capsys, main, prog):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{prog} ") and out.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["join", "--listen", "127.0.0.1:99999"], "dtfm-peer join: error: --listen: port 99999 is outside 0..65535"),
    (["join", "--listen", "localhost"], "dtfm-peer join: error: --listen: 'localhost': expected HOST:PORT"),
    (["join", "--log-level", "loud"], "dtfm-peer join: error: log.level 'loud': choose one of debug"),
    (["train", "start", "--stages", "0"],
     "dtfm-peer train start: error: argument --stages: must be a positive integer or auto, got '0'"),
    (["train", "start", "--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["train", "start", "--timeout", "-1"], "argument --timeout: must be a positive number of seconds, got '-1'"),
    (["leave", "--timeout", "nan"], "argument --timeout: must be a positive number of seconds, got 'nan'"),
    (["status", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_values_exit_2_with_usage(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        peer_main([*argv, "--data-dir", str(tmp_path / "d")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dtfm-peer") and message in err, err
    assert not (tmp_path / "d").exists()  # nothing created: no identity, no data dir


def test_sched_and_train_bad_values_exit_2(capsys):
    for main, argv in ((sched_main, ["solve", "--scenario", "worldwide", "--stages", "0"]),
                       (train_main, ["--stages", "0"])):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()



def subcommand_parsers(parser: argparse.ArgumentParser, path: str = ""):
    """Every subcommand under `parser`: its command line (`train start`), its parser and the
    one-line help its parent's `--help` lists it with. argparse has no public way to walk them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}".strip(), sub, helps.get(name)
                yield from subcommand_parsers(sub, f"{path} {name}")


@pytest.mark.parametrize("build", [peer_parser, swarm_parser])
def test_every_subcommand_has_a_description_and_a_help_line(build):
    found = list(subcommand_parsers(build()))
    assert len(found) >= 8
    for name, sub, help_line in found:
        assert sub.description and len(sub.description) > 20, f"{sub.prog} --help: no description"
        assert help_line, f"{sub.prog}: no line in its parent's --help"


# ---- the one CLI base (dtfm/cli_base.py) -----------------------------------------------------

CLI_MODULES = ("peer/cli.py", "swarm/cli.py", "sched/cli.py", "train/cli.py", "train/sample.py")


@pytest.mark.parametrize("path", CLI_MODULES)
def test_every_cli_takes_its_error_and_version_from_the_base(path):
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parent.parent / path).read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & {"CliError", "version_text", "_leaf_errors", "number", "_number", "_count", "_positive",
                          "_positive_int", "_non_negative_int", "_positive_seconds"}, path
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "dtfm.cli_base"
                for a in n.names}
    assert "run_command" in imported, f"{path} writes its own error and exit handling"
    mains = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.endswith("main")]
    assert mains and not [h for m in mains for h in ast.walk(m) if isinstance(h, ast.ExceptHandler)
                          and isinstance(h.type, ast.Name) and h.type.id == "KeyboardInterrupt"], path


def test_run_command_turns_each_outcome_into_one_exit_status(capsys):
    from dtfm.cli_base import CliError, run_command

    class Refused(Exception):
        pass

    def raising(exc: BaseException):
        def command() -> int:
            raise exc
        return command

    assert run_command("tool", lambda: 0) == 0
    assert run_command("tool", raising(CliError("no such thing: make it first"))) == 1
    assert capsys.readouterr().err == "tool: error: no such thing: make it first\n"
    # a layer's own error, alone inside nested exception groups, as trio's nurseries raise it
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [Refused("the daemon refused")])])
    assert run_command("tool", raising(nested), user_errors=(Refused,)) == 1
    assert capsys.readouterr().err == "tool: error: the daemon refused\n"
    assert run_command("tool", raising(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == ""
    assert run_command("tool", raising(KeyboardInterrupt()), say_interrupted=True) == 130
    assert capsys.readouterr().err == "tool: interrupted\n"
    # a bug keeps its traceback: an unknown type, two errors at once, a usage error's exit
    with pytest.raises(Refused):
        run_command("tool", raising(Refused("not declared")))
    with pytest.raises(ExceptionGroup):
        run_command("tool", raising(ExceptionGroup("two", [Refused("a"), CliError("b")])), user_errors=(Refused,))
    with pytest.raises(SystemExit):
        run_command("tool", raising(SystemExit(2)))


@pytest.mark.parametrize("main,argv,message", [
    (sched_main, ["solve", "--scenario", "no-such-scenario"], "dtfm-sched: error: "),
    (train_main, ["export", "--checkpoint-dir", "/nonexistent/dtfm", "--out", "/nonexistent/out"],
     "python -m dtfm.train: error: "),
])
def test_sched_and_train_user_errors_are_one_line_exit_1(capsys, main, argv, message):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("parse, text, value", [
    ("POSITIVE_INT", "3", 3), ("POSITIVE_INT", "0", None), ("POSITIVE_INT", "x", None), ("POSITIVE_INT", "1.5", None),
    ("NON_NEGATIVE_INT", "0", 0), ("NON_NEGATIVE_INT", "-1", None),
    ("POSITIVE_SECONDS", "0.5", 0.5), ("POSITIVE_SECONDS", "0", None), ("POSITIVE_SECONDS", "nan", None),
    ("POSITIVE_SECONDS", "inf", None), ("POSITIVE_SECONDS", "-1", None),
])
def test_one_number_type_for_every_cli(parse, text, value):
    import dtfm.cli_base as base
    if value is not None:
        assert getattr(base, parse)(text) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^must be a .*, got {text!r}$"):
            getattr(base, parse)(text)
    bounded = base.number(int, 2, "a count from 2 to 4", 4)
    assert bounded("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match="must be a count from 2 to 4, got '5'"):
        bounded("5")
