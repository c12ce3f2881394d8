"""What the four command-line tools (`dtfm-peer`, `dtfm-swarm`, `dtfm-sched`, `python -m
dtfm.train`) share: the error a user can act on, the `--version` text, and one way to run a
command and turn its outcome into an exit status.

Exit status, the same for every tool: 0 success, 1 an error explained on stderr as
`PROG: error: ...` (no traceback), 2 a bad command line (argparse's usage error), 130
interrupted (Ctrl-C). A tool passes the error types of the layers it calls that explain
themselves (a config error, no daemon running, a missing checkpoint); anything else is a bug and
keeps its traceback.

Below every layer (like `lazy`): it imports nothing of dtfm, so each layer's CLI may use it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "NON_NEGATIVE_INT", "POSITIVE_INT",
           "POSITIVE_SECONDS", "CliError", "DefaultsHelpFormatter", "number", "run_command", "user_error_text",
           "version_text"]

EXIT_OK = 0
EXIT_ERROR = 1  # an error explained on stderr
EXIT_USAGE = 2  # argparse's own, for a bad command line
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


class CliError(Exception):
    """A failure to report on stderr as `PROG: error: ...`, exit status 1."""


def version_text() -> str:
    """What `--version` prints (argparse's `version=`): the installed distribution's version."""
    try:
        return f"%(prog)s {importlib.metadata.version('dtfm')}"
    except importlib.metadata.PackageNotFoundError:
        return "%(prog)s (version unknown: dtfm is not installed)"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help that shows each option's default, except a default of None, whose help
    says what unset means (`--preset ... unset: tiny`, never `(default: None)`), and a flag's
    False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def number(kind: type[int] | type[float], low: float, what: str,
           high: float | None = None) -> Callable[[str], Any]:
    """An argparse type: a finite `kind` number in [low, high]; anything else is a usage error
    (exit status 2) saying `argument --flag: must be WHAT, got 'TEXT'`."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not (math.isfinite(value) and value >= low and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    parse.__name__ = what  # argparse names the type in its own messages
    return parse


POSITIVE_INT = number(int, 1, "a positive integer")
NON_NEGATIVE_INT = number(int, 0, "a non-negative integer")
POSITIVE_SECONDS = number(float, 1e-9, "a positive number of seconds")


def _leaf_errors(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaf_errors(e)]
    return [exc]


def user_error_text(exc: BaseException, user_errors: tuple[type[BaseException], ...] = ()) -> str | None:
    """The message of an error the user can act on (a CliError or one of `user_errors`, alone or
    the one error inside exception groups, as trio's nurseries raise them), or None for a bug."""
    leaves = _leaf_errors(exc)
    if len(leaves) != 1:
        return None
    leaf = leaves[0]
    if isinstance(leaf, (CliError, *user_errors)):
        return str(leaf)
    return None


def run_command(prog: str, command: Callable[[], int], *, user_errors: tuple[type[BaseException], ...] = (),
                say_interrupted: bool = False) -> int:
    """Run `command` and return its exit status: a user's error (see `user_error_text`) is one
    line on stderr and status 1; Ctrl-C is status 130 (with `PROG: interrupted` on stderr when
    `say_interrupted`); a closed stdout (`PROG status | head`) is status 1 without a traceback.
    Anything else propagates with its traceback."""
    try:
        return command()
    except KeyboardInterrupt:
        if say_interrupted:
            print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away: not an error worth a traceback. Point stdout at /dev/null so
        # the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except BaseException as e:
        text = user_error_text(e, user_errors)
        if text is None:
            raise
        print(f"{prog}: error: {text}", file=sys.stderr)
        return EXIT_ERROR
