"""`python -m dtfm.train`: JSON lines, checkpoints and resume, errors; and worker failures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtfm.train import GPTSpec, LocalCluster, Plan, StageState, TrainConfig, load_corpus
from dtfm.train.cli import build_parser, main


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    return str(path)


def run_cli(capsys, *argv) -> list[dict]:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines()]


def test_log_json_one_object_per_step(capsys, data):
    rows = run_cli(capsys, "--steps", "3", "--stages", "2", "--dp", "2", "--batch", "8", "--data", data,
                   "--log-json", "--quiet")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["loss"] > 0 and r["tokens"] == 8 * 128 for r in rows)


def test_sample_after_training(capsys, data):
    assert main(["--steps", "1", "--batch", "4", "--data", data, "--sample", "16", "--prompt", "def"]) == 0
    err = capsys.readouterr().err
    assert "--- sample after 1 steps ---\ndef" in err


def test_checkpoint_resume_continues_the_same_run(capsys, data, tmp_path):
    common = ["--stages", "2", "--batch", "4", "--micro-batches", "2", "--data", data, "--log-json", "--quiet"]
    straight = run_cli(capsys, "--steps", "4", *common)
    ck = str(tmp_path / "ck")
    first = run_cli(capsys, "--steps", "2", "--checkpoint-dir", ck, *common)
    second = run_cli(capsys, "--steps", "2", "--checkpoint-dir", ck, "--resume", *common)
    assert [r["step"] for r in first + second] == [0, 1, 2, 3]
    assert [r["loss"] for r in first + second] == [r["loss"] for r in straight]
    # a checkpoint resumes under another pipeline schedule, to the same bits
    third = run_cli(capsys, "--steps", "2", "--checkpoint-dir", ck, "--resume", "--pipeline-warmups", "1,0", *common)
    again = run_cli(capsys, "--steps", "6", *common)
    assert [r["loss"] for r in third] == [r["loss"] for r in again[4:]]


@pytest.mark.parametrize("argv,message", [
    (["--data", "{tmp}/missing"], "data path {tmp}/missing does not exist"),
    (["--resume", "--checkpoint-dir", "{tmp}"], "no checkpoint for layers"),
    (["--stages", "2", "--dp", "4", "--micro-batches", "4", "--batch", "8"], "global batch 8 is too small"),
    (["--stages", "5"], "5 stages"),
    (["--lr", "0"], "lr must be positive"),
    (["--wire-dtype", "int8"], "wire_dtype must be one of"),
    (["--stages", "4", "--pipeline-warmups", "3,2"], "pipeline_warmups names 2 stages, the pipeline has 4"),
    (["--stages", "2", "--pipeline-warmups", "0,1"], "may not warm up with more forwards than the one before"),
])
def test_user_errors_exit_1_with_one_line(capsys, tmp_path, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*argv, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m dtfm.train: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--sample", "5", "--prompt", ""], "--sample needs a non-empty --prompt"),
    (["--stages", "0"], "argument --stages: must be a positive integer, got '0'"),
    (["--layer-weights", "1,x"], "not a comma-separated list of numbers"),
    (["--keep", "0"], "argument --keep"),
    (["--preset", "huge"], "invalid choice"),
])
def test_bad_command_lines_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--quiet"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m dtfm.train: error: " in err and message in err


def test_cli_defaults_come_from_the_config():
    args = build_parser().parse_args([])
    assert args.global_batch_seqs == TrainConfig().global_batch_seqs
    assert args.wire_dtype == TrainConfig().wire_dtype


def test_failing_worker_stops_the_whole_step_quickly():
    spec = GPTSpec("t", n_layer=2, n_embd=16, n_head=2, seq_len=8)
    cfg = TrainConfig(global_batch_seqs=4, micro_batches=2, comm_timeout_s=60)
    corpus = load_corpus(max_bytes=4096)
    plan = Plan.grid(2, 2, 1)
    states = {p: StageState(spec, cfg, plan.layer_ranges[s]) for s, p in enumerate(plan.pipeline(0))}
    states[plan.pipeline(0)[1]].layer_range = (0, 1)  # the last stage now disagrees with the plan
    with pytest.raises(ValueError):
        LocalCluster(spec, cfg, plan, corpus, states=states)
    with LocalCluster(spec, cfg, plan, corpus) as cl:
        cl.states[plan.pipeline(0)[1]].layer_range = (0, 1)
        with pytest.raises(ValueError, match="holds layers"):  # not a 60 s timeout in stage 0
            cl.step()


@pytest.mark.slow
def test_module_entry_point(data):
    out = subprocess.run([sys.executable, "-m", "dtfm.train", "--steps", "2", "--batch", "4", "--data", data,
                          "--log-json", "--quiet"], capture_output=True, text=True, timeout=120, check=True)
    assert [json.loads(line)["step"] for line in out.stdout.splitlines()] == [0, 1]
