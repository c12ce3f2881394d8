"""This peer's own speed figures for the scheduler, measured without torch in the daemon.

Gossip carries two figures of each peer: its compute speed (`compute_ms`: one transformer
block's forward and backward) and its coding speed (`codec_ns`: ns per element of each codec).
Both need torch, which an idle daemon does not load (it costs about 200 MiB of private memory
per process). So the daemon measures them in a short-lived child process,

    python -m dtfm.peer.speed --device cpu --torch-threads 1 --compute --codec

which imports torch, prints one JSON object and exits (its memory goes with it), and keeps them
in its data dir (`speed.json`) under a `SpeedKey`: torch's version, the CPU model and the CPUs
this process may use, the GPU model where the stage runs on one, the device, the torch thread
count and the probe's version. A restart with the same key reads the file and starts nothing; a
changed key (a new torch, another machine, `--device` or `--torch-threads`) measures again. A
figure given in the settings (`--compute-ms`, `--codec-speed reference|free|FILE`) is used as
given and never measured.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dtfm.control import MachineNow
from dtfm.files import atomic_write
from dtfm.gossip import cpu_share
from dtfm.sched import UPDATE_KIND

__all__ = ["KIND_FILE", "KindCache", "PROBE_VERSION", "SPEED_FILE", "SpeedCache", "SpeedKey", "SelfSpeed", "speed_key"]

logger = logging.getLogger(__name__)

SPEED_FILE = "speed.json"  # in the daemon's data dir
PROBE_VERSION = 3  # bump when a probe's workload changes: older figures are measured again
PROBE_TIMEOUT_S = 300.0  # a child that has not answered by then has failed (the figure stays unknown)
MAX_FILE_BYTES = 1 << 16
MAX_CODEC_FIGURES = 64


def _child_answer(what: str, returncode: int | None, stdout: bytes, stderr: bytes) -> dict:
    """A probe child's answer: the JSON object on its last line; RuntimeError naming `what`
    when it failed (its last line of stderr) or printed none."""
    if returncode != 0:
        tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{what} failed (exit {returncode}): {tail[0][:300]}")
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        d = json.loads(lines[-1]) if lines else None
    except ValueError:
        d = None
    if not isinstance(d, dict):
        raise RuntimeError(f"{what} printed no JSON object")
    return d


@dataclass(frozen=True)
class SpeedKey:
    """What the figures depend on: any change measures them again."""

    torch: str  # torch's installed version ("" when none is installed)
    cpu: str  # the CPU model
    cpus: int  # CPUs this process may run on
    gpu: str  # the GPU model where `device` is a GPU ("" on the CPU or when unknown)
    device: str  # the stage's device (--device)
    torch_threads: int  # the stage worker's torch threads (--torch-threads)
    probe: int = PROBE_VERSION


def speed_key(device: str, torch_threads: int) -> SpeedKey:
    """This machine's key, read without importing torch."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cpus = os.cpu_count() or 1
    return SpeedKey(version, _cpu_model(), cpus, _gpu_model(device), device, torch_threads)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_model(device: str) -> str:
    """The NVIDIA driver's name of the GPU `device` names (cuda, cuda:N), "" when unknown."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return ""
    try:
        gpus = sorted(Path("/proc/driver/nvidia/gpus").iterdir())
        text = (gpus[int(index or 0)] / "information").read_text()
    except (OSError, IndexError, ValueError):
        return ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "Model":
            return value.strip()
    return ""


@dataclass(frozen=True)
class Figures:
    compute_ms: float | None = None
    codec_ns: tuple[float, ...] | None = None


class SpeedCache:
    """The figures kept in one file, for one key. A missing, damaged or other key's file holds
    nothing; writes are atomic (a temporary file renamed into place)."""

    def __init__(self, path: Path, key: SpeedKey):
        self.path, self.key = path, key

    def load(self) -> Figures:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            d = json.loads(raw) if len(raw) <= MAX_FILE_BYTES else None
        except (OSError, ValueError):
            return Figures()
        if not isinstance(d, dict) or d.get("key") != asdict(self.key):
            return Figures()
        return Figures(_compute_or_none(d.get("compute_ms")), _codec_or_none(d.get("codec_ns")))

    def store(self, figures: Figures) -> None:
        """Keep `figures`, with those of the file (same key) it does not replace."""
        old = self.load()
        compute = figures.compute_ms if figures.compute_ms is not None else old.compute_ms
        codec = figures.codec_ns if figures.codec_ns is not None else old.codec_ns
        body = {"key": asdict(self.key), "compute_ms": compute, "codec_ns": None if codec is None else list(codec)}
        try:
            atomic_write(self.path, json.dumps(body, indent=1) + "\n")
        except OSError as e:
            logger.warning("cannot keep this peer's speed figures in %s: %s (measured again at the next start)",
                           self.path, e.strerror)


def _compute_or_none(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v < 1e7:
        return None
    return float(v)


def _codec_or_none(v: object) -> tuple[float, ...] | None:
    if not isinstance(v, list) or not 0 < len(v) <= MAX_CODEC_FIGURES:
        return None
    if not all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in v):
        return None
    return tuple(float(x) for x in v)


class SelfSpeed:
    """This peer's figures: the cached ones, or a child process that measures the missing ones
    the first time one of them is asked for (`compute_ms`, `codec_ns`: blocking, for gossip's
    worker threads) and keeps them. `compute`/`codec`: whether each is to be measured at all."""

    def __init__(self, cache: SpeedCache, *, compute: bool, codec: bool,
                 command: tuple[str, ...] = (sys.executable, "-m", "dtfm.peer.speed"),
                 timeout_s: float = PROBE_TIMEOUT_S):
        self.cache, self.command, self.timeout_s = cache, command, timeout_s
        self._want_compute, self._want_codec = compute, codec
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None  # while one measures
        self._closed = False
        self.figures = cache.load()
        self.children = 0  # child processes started (status and tests)

    @property
    def measuring(self) -> bool:
        """Whether a child is measuring now."""
        return self._child is not None

    def close(self) -> None:
        """Kill the child measuring now, if any (the daemon is leaving: its worker thread
        returns at once, with no figure); no child starts afterwards. Any thread."""
        self._closed = True
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()

    def missing(self) -> bool:
        f = self.figures
        return (self._want_compute and f.compute_ms is None) or (self._want_codec and f.codec_ns is None)

    def compute_ms(self) -> float:
        """The compute figure; RuntimeError when the child could not measure it."""
        self._measure()
        if self.figures.compute_ms is None:
            raise RuntimeError("the speed probe gave no compute figure")
        return self.figures.compute_ms

    def codec_ns(self) -> tuple[float, ...]:
        """The coding figures; RuntimeError when the child could not measure them."""
        self._measure()
        if self.figures.codec_ns is None:
            raise RuntimeError("the speed probe gave no coding figures")
        return self.figures.codec_ns

    def _measure(self) -> None:
        with self._lock:
            if not self.missing():
                return
            f, key = self.figures, self.cache.key
            args = [*self.command, "--device", key.device, "--torch-threads", str(key.torch_threads)]
            if self._want_compute and f.compute_ms is None:
                args.append("--compute")
            if self._want_codec and f.codec_ns is None:
                args.append("--codec")
            if self._closed:
                raise RuntimeError("the daemon is leaving: no speed probe")
            self.children += 1
            try:
                child = self._child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                       stderr=subprocess.PIPE)
            except OSError as e:
                raise RuntimeError(f"the speed probe did not run: {e}") from None
            try:
                stdout, stderr = child.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                raise RuntimeError(f"the speed probe gave no answer within {self.timeout_s:g} s") from None
            finally:
                self._child = None
            d = _child_answer("the speed probe", child.returncode, stdout, stderr)
            got = Figures(_compute_or_none(d.get("compute_ms")) if "--compute" in args else None,
                          _codec_or_none(d.get("codec_ns")) if "--codec" in args else None)
            self.figures = Figures(got.compute_ms if got.compute_ms is not None else f.compute_ms,
                                   got.codec_ns if got.codec_ns is not None else f.codec_ns)
            self.cache.store(got)


KIND_FILE = "kinds.json"  # in the daemon's data dir: `KindCache`'s figures
REFERENCE_FRESH_S = 60.0  # a reference-block figure this recent counts as now's (`KindCache.reference_ms_now`)
MAX_KINDS = 64  # layers kept (the file is bounded: a newer layer replaces the oldest)
KIND_FIELDS = ("n_embd", "n_head", "seq_len", "mlp_ratio", "bias", "activation")  # what a layer's speed depends on


class KindCache:
    """How much slower per FLOP than the reference block a run's layer runs on this machine
    (`dtfm.control.compute.kind_factors`), by micro-batch size: measured the first time a layer
    and size are asked for, then kept, in memory and in the data dir under the same `SpeedKey`
    as the speed figures (daemons of one machine may share the file: a figure missing here is
    looked for there before it is measured, and what the others kept stays when this one
    stores). The measuring runs in this process when torch is loaded here (the
    daemon trains a stage), else in a child process (`python -m dtfm.peer.speed --kind JSON
    --batches 1,2`), so an idle daemon never loads torch. Blocking (the planner's worker
    thread, the plane's): `KindProbe`."""

    def __init__(self, path: Path, key: SpeedKey, *, command: tuple[str, ...] = (sys.executable, "-m", "dtfm.peer.speed"),
                 timeout_s: float = PROBE_TIMEOUT_S):
        self.path, self.key, self.command, self.timeout_s = path, key, command, timeout_s
        self.in_process = True  # measure in this process once torch is loaded here (tests: False)
        self._lock = threading.Lock()
        self._kinds: dict[str, dict[int, float]] = self._load()
        self.children = 0  # child processes started (tests)
        self._reference: tuple[float, float] | None = None  # (time.monotonic(), ms): the last reference-block figure

    @staticmethod
    def layer_key(spec: Any) -> str:
        return json.dumps({k: getattr(spec, k) for k in KIND_FIELDS}, sort_keys=True)

    def __call__(self, spec: Any, batches: tuple[int, ...]) -> dict[int, float]:
        layer = self.layer_key(spec)
        with self._lock:
            known = self._kinds.get(layer, {})
            missing = sorted({b for b in batches if b not in known})
            if missing:  # another daemon of this machine sharing the file may have measured them
                self._merge_file()
                known = self._kinds.get(layer, {})
                missing = sorted({b for b in batches if b not in known})
            if missing:
                got = self._measure(spec, missing)
                # (a size not probed: the reference rate; an update not measured: not counted)
                known = {**known, **got, **{b: 1.0 for b in missing if b not in got and b != UPDATE_KIND}}
                self._kinds.pop(layer, None)
                self._kinds[layer] = known
                while len(self._kinds) > MAX_KINDS:
                    self._kinds.pop(next(iter(self._kinds)))
                self._store()
            return {b: known[b] for b in batches if b in known}

    def reference_ms_now(self) -> float:
        """The reference block's time on this machine now (`compute_speed_ms`, never kept: the
        load it sees is now's): the figure of a layer probe of the last REFERENCE_FRESH_S, else
        measured (here once torch is loaded, else in a child process). Blocking; RuntimeError
        when the probe cannot run."""
        with self._lock:
            if self._reference is not None and time.monotonic() - self._reference[0] <= REFERENCE_FRESH_S:
                return self._reference[1]
            if "torch" in sys.modules and self.in_process:
                from dtfm.gossip import compute_speed_ms
                figure = _compute_or_none(compute_speed_ms())
            else:
                figure = _compute_or_none(self._child(["--compute"]).get("compute_ms"))
            if figure is None:
                raise RuntimeError("the compute probe gave no figure")
            self._reference = (time.monotonic(), figure)
            return figure

    def machine_now(self) -> MachineNow:
        """This machine now, for the first placement: the reference block's time
        (`reference_ms_now`), the share of a core one busy thread gets (`cpu_share`, timed here:
        it needs no torch) and the cores this process may use. Blocking; RuntimeError when the
        compute probe cannot run."""
        ms = self.reference_ms_now()
        return MachineNow(ms, cpu_share(), max(1, self.key.cpus))

    def _measure(self, spec: Any, batches: list[int]) -> dict[int, float]:
        if "torch" in sys.modules and self.in_process:
            # (this daemon trains or trained a stage: torch is loaded, and the probe takes a few
            # hundred ms here; a child would load torch again, on every training peer at once)
            from dtfm.control import kind_factors
            from dtfm.gossip import compute_speed_ms
            out = kind_factors(spec, batches)
            self._reference = (time.monotonic(), compute_speed_ms())
            return out
        d = self._child(["--kind", json.dumps(spec.to_dict()), "--batches", ",".join(map(str, batches)), "--compute"])
        ms = _compute_or_none(d.get("compute_ms"))
        if ms is not None:
            self._reference = (time.monotonic(), ms)
        figures = d.get("kind")
        if not isinstance(figures, dict):
            raise RuntimeError("the layer probe printed no figures")
        return {int(b): float(f) for b, f in figures.items()
                if str(b).isdigit() and int(b) in batches and _kind_or_none(f, int(b)) is not None}

    def _child(self, what: list[str]) -> dict:
        """Run the probe child with `what` asked; its JSON object (RuntimeError when none)."""
        args = [*self.command, "--torch-threads", str(self.key.torch_threads), *what]
        self.children += 1
        try:
            done = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"the layer probe did not answer: {e}") from None
        return _child_answer("the layer probe", done.returncode, done.stdout, done.stderr)

    def _load(self) -> dict[str, dict[int, float]]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            d = json.loads(raw) if len(raw) <= MAX_FILE_BYTES else None
        except (OSError, ValueError):
            return {}
        if not isinstance(d, dict) or d.get("key") != asdict(self.key) or not isinstance(d.get("kinds"), dict):
            return {}
        out: dict[str, dict[int, float]] = {}
        for layer, figures in list(d["kinds"].items())[-MAX_KINDS:]:
            if isinstance(layer, str) and isinstance(figures, dict):
                out[layer] = {int(b): float(f) for b, f in figures.items()
                              if str(b).isdigit() and _kind_or_none(f, int(b)) is not None}
        return out

    def _merge_file(self) -> None:
        """Take in what another daemon sharing the file kept (this one's figures win), the
        file's layers counted older than this one's."""
        kept = self._load()
        merged = {layer: figures for layer, figures in kept.items() if layer not in self._kinds}
        for layer, figures in self._kinds.items():
            merged[layer] = {**kept.get(layer, {}), **figures}
        self._kinds = merged
        while len(self._kinds) > MAX_KINDS:
            self._kinds.pop(next(iter(self._kinds)))

    def _store(self) -> None:
        self._merge_file()
        body = {"key": asdict(self.key),
                "kinds": {layer: {str(b): f for b, f in figures.items()} for layer, figures in self._kinds.items()}}
        try:
            atomic_write(self.path, json.dumps(body, indent=1) + "\n")
        except OSError as e:
            logger.warning("cannot keep the layer figures in %s: %s (measured again at the next start)",
                           self.path, e.strerror)


MAX_UPDATE_FLOPS_PER_PARAM = 1e6  # an update figure (`UPDATE_KIND`) above this is refused


def _kind_or_none(v: object, batch: int) -> float | None:
    """A layer figure as kept: a time-per-FLOP ratio in (0.01, 100), or for `UPDATE_KIND`
    FLOP-equivalents per parameter in (0, MAX_UPDATE_FLOPS_PER_PARAM); None for anything else."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    low, high = (0.0, MAX_UPDATE_FLOPS_PER_PARAM) if batch == UPDATE_KIND else (0.01, 100.0)
    return float(v) if low < v < high else None


def main(argv: list[str] | None = None) -> int:
    """The child: measure the asked figures in this process (torch imported here) and print
    them as one JSON object."""
    parser = argparse.ArgumentParser(prog="python -m dtfm.peer.speed",
                                     description="Measure this machine's speed figures for dtfm's scheduler and "
                                                 "print them as one JSON object (the daemon runs it once and "
                                                 "keeps the result in its data dir).")
    parser.add_argument("--device", default="cpu", help="where a stage runs (cpu, cuda, cuda:N)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch threads of the stage worker")
    parser.add_argument("--compute", action="store_true", help="one transformer block's forward+backward, in ms")
    parser.add_argument("--codec", action="store_true", help="each codec's ns per element")
    parser.add_argument("--kind", metavar="JSON", help="a model spec (GPTSpec as JSON): its layer's time per FLOP "
                                                       "over the reference block's, at each --batches size")
    parser.add_argument("--batches", default="1", help="micro-batch sizes for --kind, comma-separated (0: the "
                                                       "optimizer update, FLOP-equivalents per parameter)")
    args = parser.parse_args(argv)
    import torch

    from dtfm.control import kind_factors
    from dtfm.gossip import compute_speed_ms
    from dtfm.train import GPTSpec, peer_codec_speed

    torch.set_num_threads(max(1, args.torch_threads))
    out: dict[str, object] = {}
    if args.kind:
        spec = GPTSpec.from_dict(json.loads(args.kind))
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        out["kind"] = {str(b): f for b, f in kind_factors(spec, batches).items()}
    if args.compute:
        out["compute_ms"] = compute_speed_ms()
    if args.codec:
        out["codec_ns"] = list(peer_codec_speed(args.torch_threads, args.device).to_vector())
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
