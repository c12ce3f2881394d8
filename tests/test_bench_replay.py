"""bench/replay.py: the checkpoints of a swarm's run, joined and replayed in one process, against
the losses the swarm logged."""

import dataclasses
import json

from bench_modules import load_bench

from dtfm.train import (TrainConfig, get_preset, load_corpus, reference_state, reference_step, save_checkpoint,
                        stage_from_tensors, stage_tensors)

bench = load_bench("replay")
SPEC = dataclasses.replace(get_preset("tiny"), n_layer=2, n_embd=32, n_head=2, seq_len=32)
CFG = TrainConfig(seed=3, global_batch_seqs=4, micro_batches=1)


def _run_dir(tmp_path, *, at: int = 2, logged: int = 5, wrong_step: int | None = None):
    """A run dir as a 2-stage swarm leaves it: each stage's checkpoint of step `at`, in the data
    dir of a peer of its own, and train.jsonl with one process's losses for steps 0..logged-1
    (the one at `wrong_step` off by 1e-3)."""
    state, corpus = reference_state(SPEC, CFG), load_corpus()
    losses = [reference_step(state, corpus) for _ in range(at)]
    whole = stage_tensors(state)
    for peer, layers in (("p00", (0, 1)), ("p01", (1, SPEC.n_layer))):
        stage = stage_from_tensors(SPEC, CFG, layers, whole, at, state.optim.step_count)
        save_checkpoint(tmp_path / peer / "checkpoints" / "ab", stage)
    losses += [reference_step(state, corpus) for _ in range(logged - at)]
    if wrong_step is not None:
        losses[wrong_step] *= 1 + 1e-3
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"step": k, "loss": x}) + "\n" for k, x in enumerate(losses)))
    return tmp_path


def test_the_steps_after_a_checkpoint_replay_to_the_logged_losses(tmp_path):
    result = bench.replay(_run_dir(tmp_path), bench.Replay(), max_steps=3, say=lambda m: None)
    assert result.replayed == {2} and result.steps == 3 and not result.failures
    assert result.to_dict()["exact"] and result.worst_relative < 1e-6
    again = bench.replay(tmp_path, result, max_steps=3, say=lambda m: None)  # (a checkpoint is replayed once)
    assert again.steps == 3


def test_a_step_logged_from_wrong_weights_is_found(tmp_path):
    result = bench.replay(_run_dir(tmp_path, wrong_step=3), bench.Replay(), max_steps=3, say=lambda m: None)
    assert not result.to_dict()["exact"] and 5e-4 < result.worst_relative < 2e-3


def test_a_checkpoint_whose_steps_are_not_logged_yet_waits(tmp_path):
    result = bench.replay(_run_dir(tmp_path, logged=4), bench.Replay(), max_steps=3, say=lambda m: None)
    assert result.replayed == set() and result.steps == 0 and not result.to_dict()["exact"]


def test_a_stage_without_its_checkpoint_leaves_the_step_unreplayed(tmp_path):
    run_dir = _run_dir(tmp_path)
    for f in (run_dir / "p01").rglob("step-*"):
        f.unlink()
    result = bench.replay(run_dir, bench.Replay(), max_steps=3, say=lambda m: None)
    assert result.replayed == set() and not result.failures


def test_coverage_counts_the_final_log_steps_a_replay_compared(tmp_path):
    run_dir = _run_dir(tmp_path, logged=5)
    result = bench.replay(run_dir, bench.Replay(), max_steps=3, say=lambda m: None)
    rows = [json.loads(x) for x in (run_dir / "train.jsonl").read_text().splitlines()]
    assert result.to_dict(rows)["coverage"] == 3 / 5  # (steps 2-4 of 0-4)
    rows[3]["loss"] += 1e-3  # a rollback ran step 3 again after its replay: not covered any more
    assert result.coverage(rows) == 2 / 5
