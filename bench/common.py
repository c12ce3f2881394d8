"""What the benches share: `dtfm-swarm` driven as a subprocess (a swarm up for the length of a
`with`, its commands, its step log) and the markdown tables they print.

The benches run as `python bench/X.py`, which puts bench/ first on sys.path: they import this
module as `common`."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

# The worldwide and recovery figures are a deployment's: the control plane's wan timings, not the
# test profile a swarm on one machine runs by default (README's figures were measured so).
WAN_PLANE = ("--plane-profile", "wan")


def swarm(run_dir: Path, *args: str, timeout_s: float = 900, stdout: bool = False) -> str:
    """Run `dtfm-swarm ARGS`; its stderr (or stdout), or RuntimeError with its stderr."""
    cmd = [sys.executable, "-m", "dtfm.swarm", *args, "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"dtfm-swarm {args[0]} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return out.stdout if stdout else out.stderr


@contextlib.contextmanager
def running_swarm(*up_args: str, up_timeout_s: float = 900, kill: bool = False,
                  prefix: str = "dtfm-bench-") -> Iterator[Path]:
    """The run dir of a swarm started by `dtfm-swarm up UP_ARGS` in a temporary folder, taken
    down when the `with` ends: `down`, or with `kill` `down --kill`. An `up` that fails is
    followed by `down --kill` for what it started, if anything, then its error."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        run_dir = Path(tmp) / "swarm"
        try:
            swarm(run_dir, "up", *up_args, timeout_s=up_timeout_s)
        except BaseException:
            if run_dir.exists():
                kill_swarm(run_dir)
            raise
        try:
            yield run_dir
        finally:
            if kill:
                kill_swarm(run_dir)
            else:
                swarm(run_dir, "down")


def kill_swarm(run_dir: Path) -> None:
    """`dtfm-swarm down --kill`; a failure of it is printed, not raised."""
    try:
        swarm(run_dir, "down", "--kill", timeout_s=120)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"dtfm-swarm down --kill: {e}", file=sys.stderr)


def wait_for(what: str, condition: Callable[[], object], timeout_s: float, interval_s: float = 1.0) -> object:
    """Poll `condition()` (the daemons are other processes: there is no event to wait on) until
    it is truthy and return it; RuntimeError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)
    return result


def read_rows(run_dir: Path) -> list[dict]:
    """The swarm's step log, train.jsonl: one dict per line."""
    return [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines() if line.strip()]


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """A markdown table on stderr (stdout holds a bench's JSON line), after an empty line."""
    print("\n| " + " | ".join(header) + " |", file=sys.stderr)
    print("|" + "---|" * len(header), file=sys.stderr)
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |", file=sys.stderr)


def write_json(path: Path, value: object) -> None:
    """`value` as indented JSON at `path`, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1))
