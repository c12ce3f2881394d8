"""This peer's speed figures (peer/speed.py): measured by a child process, kept in the data dir
under the key of what they depend on, read back on restart, measured again when the key changes."""

import dataclasses
import json
import subprocess
import sys

import pytest

from dtfm.peer.config import DaemonConfig
from dtfm.peer.services import self_speed
from dtfm.peer.settings import merge
from dtfm.peer.speed import SPEED_FILE, SelfSpeed, SpeedCache, SpeedKey, speed_key
from dtfm.sched import CodecSpeed

KEY = SpeedKey(torch="2.5.1", cpu="Test CPU @ 1 GHz", cpus=2, gpu="", device="cpu", torch_threads=1)
CODEC = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]

# A stand-in for `python -m dtfm.peer.speed`: prints the asked figures and counts its runs in a
# file beside it (no torch, no seconds spent measuring).
FAKE_CHILD = r"""
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
runs.write_text(runs.read_text() + " ".join(sys.argv[2:]) + "\n" if runs.exists() else " ".join(sys.argv[2:]) + "\n")
out = {}
if "--compute" in sys.argv:
    out["compute_ms"] = 12.5
if "--codec" in sys.argv:
    out["codec_ns"] = %s
print("some torch warning")
print(json.dumps(out))
""" % CODEC


def fake(tmp_path, key=KEY, *, compute=True, codec=True, script=FAKE_CHILD) -> tuple[SelfSpeed, object]:
    runs = tmp_path / "runs.txt"
    child = (sys.executable, "-c", script, str(runs))
    return SelfSpeed(SpeedCache(tmp_path / SPEED_FILE, key), compute=compute, codec=codec, command=child), runs


def child_runs(runs) -> list[str]:
    return runs.read_text().splitlines() if runs.exists() else []


def test_one_child_measures_both_figures_and_a_restart_reads_them(tmp_path):
    speed, runs = fake(tmp_path)
    assert speed.missing()
    assert speed.compute_ms() == 12.5 and speed.codec_ns() == tuple(CODEC)
    assert child_runs(runs) == ["--device cpu --torch-threads 1 --compute --codec"]  # one child for both
    kept = json.loads((tmp_path / SPEED_FILE).read_text())
    assert kept["key"] == dataclasses.asdict(KEY) and kept["compute_ms"] == 12.5 and kept["codec_ns"] == CODEC

    again, _ = fake(tmp_path)  # the daemon restarted: same key
    assert not again.missing() and again.figures.compute_ms == 12.5 and again.figures.codec_ns == tuple(CODEC)
    assert again.compute_ms() == 12.5 and again.codec_ns() == tuple(CODEC)
    assert len(child_runs(runs)) == 1 and again.children == 0


@pytest.mark.parametrize("change", [{"torch": "2.6.0"}, {"cpu": "Other CPU"}, {"cpus": 8}, {"device": "cuda:0"},
                                    {"torch_threads": 4}, {"probe": 0}])
def test_a_changed_key_measures_again(tmp_path, change):
    speed, runs = fake(tmp_path)
    speed.codec_ns()
    changed = dataclasses.replace(KEY, **change)
    other, _ = fake(tmp_path, changed)
    assert other.missing() and other.figures.compute_ms is None and other.figures.codec_ns is None
    other.compute_ms()
    assert len(child_runs(runs)) == 2 and child_runs(runs)[1].endswith("--compute --codec")
    assert json.loads((tmp_path / SPEED_FILE).read_text())["key"] == dataclasses.asdict(changed)


def test_only_the_missing_figure_is_measured_and_the_other_is_kept(tmp_path):
    speed, runs = fake(tmp_path, compute=False)  # --compute-ms given: only the coding speed is measured
    assert speed.codec_ns() == tuple(CODEC)
    assert child_runs(runs) == ["--device cpu --torch-threads 1 --codec"]
    both, _ = fake(tmp_path)  # later the compute figure is wanted too: measured alone, the codec kept
    assert both.missing() and both.figures.codec_ns == tuple(CODEC)
    assert both.compute_ms() == 12.5
    assert child_runs(runs)[1] == "--device cpu --torch-threads 1 --compute"
    assert json.loads((tmp_path / SPEED_FILE).read_text())["codec_ns"] == CODEC


@pytest.mark.parametrize("text", ["{", "[1, 2]", '{"key": "x"}', "x" * 70000,
                                  json.dumps({"key": dataclasses.asdict(KEY), "compute_ms": -1, "codec_ns": [1]}),
                                  json.dumps({"key": dataclasses.asdict(KEY), "compute_ms": "1", "codec_ns": "abc"})])
def test_a_damaged_file_is_measured_again(tmp_path, text):
    (tmp_path / SPEED_FILE).write_text(text)
    speed, runs = fake(tmp_path)
    assert speed.missing()
    assert speed.compute_ms() == 12.5 and len(child_runs(runs)) == 1


@pytest.mark.parametrize("script,why", [("import sys; sys.exit('no torch here')", "exit 1"),
                                        ("print('not json')", "no JSON object"),
                                        ("print('{}')", "no compute figure")])
def test_a_failed_child_leaves_the_figures_unknown_and_keeps_nothing(tmp_path, script, why):
    speed, _ = fake(tmp_path, script=script)
    with pytest.raises(RuntimeError, match=why):
        speed.compute_ms()
    if why == "no compute figure":  # (it answered, with nothing: the file says so, the next start asks again)
        assert SelfSpeed(SpeedCache(tmp_path / SPEED_FILE, KEY), compute=True, codec=False).missing()
    else:
        assert not (tmp_path / SPEED_FILE).exists()


def test_close_kills_a_measuring_child_and_starts_no_other(tmp_path):
    # the daemon leaves while its child measures: the worker thread must return at once
    import threading
    import time

    speed, _ = fake(tmp_path, script="import time; time.sleep(60)")
    failed: list[str] = []

    def measure() -> None:
        try:
            speed.compute_ms()
        except RuntimeError as e:
            failed.append(str(e))

    worker = threading.Thread(target=measure)
    worker.start()
    deadline = time.monotonic() + 30
    while not speed.measuring and time.monotonic() < deadline:  # (the child has started)
        time.sleep(0.01)
    speed.close()
    worker.join(30)
    assert not worker.is_alive() and failed and "exit -9" in failed[0]
    with pytest.raises(RuntimeError, match="leaving"):
        speed.codec_ns()
    assert speed.children == 1 and not (tmp_path / SPEED_FILE).exists()


def test_the_daemon_measures_only_what_its_settings_leave_unknown(tmp_path):
    given = merge(DaemonConfig(), {"gossip": {"compute_ms": 3.0, "codec_speed": "reference"}})
    assert self_speed(given, tmp_path, compute=False, codec=False) is None
    cfg = merge(DaemonConfig(), {"plane": {"torch_threads": 3}})
    speed = self_speed(cfg, tmp_path, compute=True, codec=True)
    assert speed is not None and speed.cache.path == tmp_path / SPEED_FILE
    assert speed.cache.key == speed_key("cpu", 3) and speed.cache.key.torch_threads == 3
    assert speed.cache.key.torch  # read from the installed distribution, without importing torch


@pytest.mark.slow
def test_the_real_child_prints_figures_gossip_accepts():
    out = subprocess.run([sys.executable, "-m", "dtfm.peer.speed", "--compute", "--codec"], capture_output=True,
                         text=True, timeout=110, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert d["compute_ms"] > 0
    CodecSpeed.from_vector(tuple(d["codec_ns"]))  # (raises unless it is a codec speed)


async def test_the_figures_of_a_compute_probe_reach_every_view(autojump_clock):
    """What the daemon's probe (SelfSpeed.compute_ms, here a stand-in) gives is what every peer's
    view holds; a probe that fails leaves that peer's figure unknown and the service running."""
    import numpy as np
    import trio

    from dtfm.gossip.config import GossipConfig
    from dtfm.gossip.harness import Harness

    def probe(k: int) -> float:
        if k == 2:
            raise RuntimeError("the speed probe did not run")
        return 10.0 + k

    async with trio.open_nursery() as nursery:
        h = Harness(3, GossipConfig.test(), seed=7, measure=True, compute_probe=probe)
        await h.start(nursery)
        with trio.fail_after(120):
            while not all(np.isfinite(s.view().compute_ms).sum() == 2 for s in h.services):
                await trio.sleep(0.5)
        for s in h.services:
            view = s.view()
            figures = {h.index[p]: view.compute_ms[i] for i, p in enumerate(view.peers)}
            assert figures[0] == 10.0 and figures[1] == 11.0 and np.isnan(figures[2])
        assert h.services[2].compute_ms is None
        nursery.cancel_scope.cancel()
