"""A run layer's speed against the reference block (peer/speed.py `KindCache`, control/compute.py
`kind_factors`): measured by a child process once per layer and micro-batch, kept in the data dir
under the speed key, a failed probe an error the planner turns into the reference rate."""

import json
import math
import sys

import numpy as np
import pytest

from dtfm.control.compute import kind_factors, peer_compute, training_block_ms
from dtfm.gossip import NetworkView
from dtfm.peer.speed import KIND_FILE, MAX_UPDATE_FLOPS_PER_PARAM, KindCache, SpeedKey
from dtfm.train import GPTSpec, TrainConfig, get_preset

KEY = SpeedKey(torch="2.5.1", cpu="Test CPU @ 1 GHz", cpus=2, gpu="", device="cpu", torch_threads=1)

# A stand-in for `python -m dtfm.peer.speed --kind`: factor 1 + batch / 10, its runs counted in a
# file; it fails for a layer of 17 tokens.
FAKE_CHILD = r"""
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
args = sys.argv[2:]
if "--kind" not in args:  # the reference block alone, timed now
    runs.write_text((runs.read_text() if runs.exists() else "") + "compute\n")
    print(json.dumps({"compute_ms": 42.0}))
    sys.exit(0)
runs.write_text((runs.read_text() if runs.exists() else "") + args[args.index("--batches") + 1] + "\n")
if '"seq_len": 17' in args[args.index("--kind") + 1]:
    sys.exit("no torch here")
batches = [int(b) for b in args[args.index("--batches") + 1].split(",")]
# the update (batch 0): 500 FLOP-equivalents per parameter; 2e6 for a layer of 33 tokens (out of bounds)
update = 2e6 if '"seq_len": 33' in args[args.index("--kind") + 1] else 500.0
print(json.dumps({"kind": {str(b): (update if b == 0 else 1 + b / 10) for b in batches if b < 64},
                  "compute_ms": 40.0 if "--compute" in args else None}))
"""


def fake(tmp_path) -> tuple[KindCache, object]:
    runs = tmp_path / "runs.txt"
    cache = KindCache(tmp_path / KIND_FILE, KEY, command=(sys.executable, "-c", FAKE_CHILD, str(runs)))
    cache.in_process = False  # (the fake child's figures, though this test process has torch loaded)
    return cache, runs


def test_a_layer_is_probed_once_per_micro_batch_and_a_restart_reads_it(tmp_path):
    kinds, runs = fake(tmp_path)
    tiny = get_preset("tiny")
    assert kinds(tiny, (1, 2)) == {1: 1.1, 2: 1.2}
    assert kinds(tiny, (2, 1)) == {1: 1.1, 2: 1.2} and kinds.children == 1
    assert kinds(tiny, (2, 4, 64)) == {2: 1.2, 4: 1.4, 64: 1.0}  # (a size the probe left out: the reference rate)
    assert runs.read_text().splitlines() == ["1,2", "4,64"]
    # another model with the same layer (depth, vocabulary and name aside) shares the figures
    deeper = GPTSpec("deeper", n_layer=12, n_embd=tiny.n_embd, n_head=tiny.n_head, seq_len=tiny.seq_len, vocab=512)
    assert kinds(deeper, (4,)) == {4: 1.4} and kinds.children == 2
    again, _ = fake(tmp_path)  # the daemon restarted: same key
    assert again(tiny, (1, 2, 4)) == {1: 1.1, 2: 1.2, 4: 1.4} and again.children == 0
    other = KindCache(tmp_path / KIND_FILE, SpeedKey(**{**KEY.__dict__, "torch": "9.9"}),
                      command=again.command)  # a new torch: measured again
    other.in_process = False
    other(tiny, (1,))
    assert other.children == 1


def test_daemons_sharing_one_file_probe_a_layer_once_and_keep_each_others_figures(tmp_path):
    """Two daemons of one machine with one kinds file (dtfm-swarm's peers): a figure the other
    measured after this one started is read, not measured again; each one's store keeps what
    the other kept."""
    coordinator, runs = fake(tmp_path)
    trainer, _ = fake(tmp_path)  # started before anything was measured
    tiny = get_preset("tiny")
    assert coordinator(tiny, (1, 2)) == {1: 1.1, 2: 1.2}
    assert trainer(tiny, (2,)) == {2: 1.2} and trainer.children == 0
    assert trainer(tiny, (8,)) == {8: 1.8} and coordinator(tiny, (16,)) == {16: 2.6}
    assert runs.read_text().splitlines() == ["1,2", "8", "16"]
    later, _ = fake(tmp_path)
    assert later(tiny, (1, 2, 8, 16)) == {1: 1.1, 2: 1.2, 8: 1.8, 16: 2.6} and later.children == 0


def test_the_update_is_kept_within_its_bounds_and_the_reference_timed_with_the_layer_counts_as_now(tmp_path):
    kinds, runs = fake(tmp_path)
    tiny = get_preset("tiny")
    assert kinds(tiny, (0, 1)) == {0: 500.0, 1: 1.1}
    assert kinds.reference_ms_now() == 40.0 and kinds.children == 1  # (timed by the layer's probe just now)
    odd = GPTSpec("odd", n_layer=1, n_embd=64, n_head=2, seq_len=33, vocab=64)
    assert kinds(odd, (0, 1)) == {1: 1.1}  # an update figure out of bounds is refused, not taken as 1
    again, _ = fake(tmp_path)
    assert again(tiny, (0,)) == {0: 500.0} and again.children == 0  # kept in the file
    assert again.reference_ms_now() == 42.0 and again.children == 1  # never kept: timed now, in a child
    assert runs.read_text().splitlines() == ["0,1", "0,1", "compute"]


def test_a_failed_probe_raises_and_keeps_nothing(tmp_path):
    kinds, _ = fake(tmp_path)
    failing = GPTSpec("any", n_layer=2, n_embd=64, n_head=2, seq_len=17, vocab=64)  # (the fake fails on it)
    with pytest.raises(RuntimeError, match="no torch here"):
        kinds(failing, (1,))
    assert not (tmp_path / KIND_FILE).exists()


def test_a_damaged_kinds_file_holds_nothing(tmp_path):
    (tmp_path / KIND_FILE).write_text("{not json")
    kinds, runs = fake(tmp_path)
    assert kinds(get_preset("tiny"), (1,)) == {1: 1.1}
    assert json.loads((tmp_path / KIND_FILE).read_text())["key"]["torch"] == "2.5.1"


def test_kind_factors_times_a_narrow_layer_and_skips_a_huge_one():
    """The real probe, small: a factor per size, positive and finite; a layer the reference
    predicts slower than KIND_MAX_LAYER_S is left out."""
    narrow = GPTSpec("narrow", n_layer=1, n_embd=64, n_head=2, seq_len=32, vocab=64)
    got = kind_factors(narrow, (0, 1, 2), repeats=3, min_s=0.5)
    assert sorted(got) == [0, 1, 2] and all(0 < f and math.isfinite(f) for b, f in got.items() if b)
    assert 0 < got[0] < MAX_UPDATE_FLOPS_PER_PARAM  # the update: FLOP-equivalents per parameter
    huge = GPTSpec("huge", n_layer=1, n_embd=8192, n_head=64, seq_len=4096, vocab=64)
    assert kind_factors(huge, (64,), repeats=1, min_s=0.0) == {}


def test_a_kind_factor_costs_the_layers_slower_and_a_peer_reports_in_reference_units():
    """The planner scales the compute term by the factor; a training peer divides its figure by
    it: the simulator costs the peer's own step at what it measured."""
    cfg = TrainConfig(global_batch_seqs=16, micro_batches=4)
    spec = get_preset("tiny")
    view = NetworkView(tuple(bytes([k]) * 32 for k in range(2)), np.zeros((2, 2)), np.full((2, 2), np.inf),
                       np.full(2, 20.0), True)
    plain, slow = peer_compute(view), peer_compute(view, {4: 2.0})
    assert slow.tflops(4) == plain.tflops(4) / 2 and slow.tflops(2) == plain.tflops(2)
    ms = training_block_ms(spec, cfg, 1, spec.n_layer, True, 0.5, kind=2.0)
    reported = peer_compute(NetworkView(view.peers, view.delay_ms, view.bandwidth_gbps, np.full(2, ms), True),
                            {4: 2.0})
    wl = reported.spec(spec, cfg, 1).workload(1, 1)
    assert math.isclose(wl.compute_layers(np.array([spec.n_layer]))[0] * wl.layer_compute_s * cfg.micro_batches,
                        0.5, rel_tol=1e-9)


def test_a_daemon_with_torch_loaded_measures_in_itself(tmp_path):
    """Once torch is loaded (the daemon trains a stage) no child starts: the probe runs here."""
    import torch  # noqa: F401  (loaded, as in a daemon that trains)
    kinds, runs = fake(tmp_path)
    kinds.in_process = True
    narrow = GPTSpec("narrow", n_layer=1, n_embd=64, n_head=2, seq_len=32, vocab=64)
    got = kinds(narrow, (1,))
    assert sorted(got) == [1] and 0 < got[1] < 100 and kinds.children == 0 and not runs.exists()


def test_probe_figures_are_means_and_ratios_of_sums_over_their_runs():
    """A slow run (a time slice lost) weighs by its time, as in training: a ratio of sums, not
    a median of single-run ratios, which would read 1.0 here."""
    from dtfm.control.compute import paired_ratio
    from dtfm.gossip import mean_ms
    runs = iter([10.0, 10.0, 40.0, 10.0, 10.0])
    refs = iter([10.0, 10.0, 10.0, 10.0, 10.0])
    assert paired_ratio(lambda: next(runs), lambda: next(refs), min_runs=5, min_s=0.0) == pytest.approx(80 / 50)
    # chunks of 200 ms in turn: a stall of seconds in one reference run moves one chunk, not the figure
    runs = iter([100.0] * 12)
    refs = iter([100.0] * 5 + [5000.0] + [100.0] * 6)
    assert paired_ratio(lambda: next(runs), lambda: next(refs), min_runs=12, min_s=0.0) == pytest.approx(1.0)
    figures = iter([3.0, 5.0, 10.0])
    assert mean_ms(lambda: next(figures), min_runs=3, min_s=0.0) == pytest.approx(6.0)
    calls = []
    assert mean_ms(lambda: calls.append(1) or 1.0, min_runs=1, min_s=60.0, max_runs=7) == 1.0 and len(calls) == 7
