"""The swarm path's training knobs, run-spec files, model folders and device, at unit level:
`TrainRequest`'s reading of a signed start's knobs, the operator-start comparison, the run-spec
file (`dtfm-peer train start --spec`), the daemon's `--device`, `--model-dir` and `--tokenizer`,
and a stage built from a model folder. The multi-process run (a GPT-2 built here, imported with
`--init-from`, trained in a swarm with knobs, exported, compared with transformers) is in
tests/swarm/test_swarm_train.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import save_gpt2
from machine_trace import CFG, OPERATOR, OPERATORS, RUN, alloc, start_op

from dtfm.control import (
    KNOBS,
    Allocation,
    OperatorOp,
    SignedOp,
    TrainError,
    TrainRequest,
    check_operator_start,
    hf_preset,
    sign_op,
)
from dtfm.control.allocation.fields import config_to_wire
from dtfm.control.models import load_held_models, model_refusal, start_model
from dtfm.peer import ConfigError, load_run_spec, resolve, start_request
from dtfm.peer import cli as peer_cli
from dtfm.peer.config import PlaneSection
from dtfm.train import PRESETS, CompressionConfig, TrainConfig, hf_digest, hf_stage_state, load_hf, parse_compression

DATA = "ab" * 32
BASE = {"preset": "tiny", "steps": 10, "seed": 3, "data_hash": DATA, "data_name": "d"}


# ---- the signed start's knobs ----------------------------------------------------------------------


def test_knobs_round_trip_and_are_signed_only_where_they_differ_from_the_defaults():
    plain = TrainRequest.from_args(BASE)
    assert plain.train is None and plain.config == TrainConfig(seed=3)
    assert not set(plain.to_args()) & set(KNOBS)  # a start without knobs signs what it signed before
    req = TrainRequest.from_args({**BASE, "lr": 3e-4, "warmup_steps": 5, "global_batch_seqs": 32, "micro_batches": 8,
                                  "wire_dtype": "bfloat16", "weight_decay": 0.0, "grad_clip_norm": 0})
    assert req.config == TrainConfig(seed=3, lr=3e-4, warmup_steps=5, global_batch_seqs=32, micro_batches=8,
                                     wire_dtype="bfloat16", weight_decay=0.0, grad_clip_norm=0.0)
    assert TrainRequest.from_args(req.to_args()) == req
    assert TrainRequest.from_args({**BASE, "lr": TrainConfig().lr}).to_args() == plain.to_args()
    op = OperatorOp("start", b"\x01" * 32, b"r" * 16, 0, req.to_args())  # 19 arguments fit in a signed start
    assert OperatorOp.decode(op.encode()) == op
    bf16 = TrainRequest.from_args({**BASE, "precision": "bf16"})
    assert bf16.config == TrainConfig(seed=3, precision="bf16") and bf16.to_args()["precision"] == "bf16"
    assert TrainRequest.from_args(bf16.to_args()) == bf16 and "precision" not in plain.to_args()


def test_the_precision_travels_in_the_allocation_only_where_it_is_not_fp32():
    """An fp32 run's allocation has the bytes it had before precision existed (the golden
    fixtures pin them); a bf16 run's train map says so, and decodes to a bf16 run."""
    fp32, bf16 = alloc(), alloc(train=dataclasses.replace(CFG, precision="bf16"))
    assert "precision" not in config_to_wire(fp32.train, "train") and config_to_wire(bf16.train, "train")["precision"] == "bf16"
    assert Allocation.decode(fp32.encode()) == fp32 and Allocation.decode(fp32.encode()).train.precision == "fp32"
    assert Allocation.decode(bf16.encode()) == bf16 and Allocation.decode(bf16.encode()).train.precision == "bf16"


@pytest.mark.parametrize("args, words", [
    ({"lr": "fast"}, "lr must be a number"),
    ({"micro_batches": 2.5}, "micro_batches must be an integer"),
    ({"warmup_steps": True}, "warmup_steps must be an integer"),
    ({"lr": -1.0}, "lr must be positive"),
    ({"wire_dtype": "int8"}, "wire_dtype must be one of"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"precision": 16}, "precision must be a string"),
    ({"global_batch_seqs": 4, "micro_batches": 8}, "global batch 4 is too small for 1 pipelines x 8 micro-batches"),
    ({"global_batch_seqs": 8, "micro_batches": 2, "stages": 2, "dp": 8}, "global batch 8 is too small for 8 pipelines"),
    ({"init_from": "ef" * 32}, "it names no preset"),
    ({"init_from": "EF" * 32, "preset": None}, "init_from must be 64 lowercase hex digits"),
])
def test_a_bad_knob_is_refused_with_its_name(args, words):
    with pytest.raises(TrainError, match=words):
        TrainRequest.from_args({k: v for k, v in {**BASE, **args}.items() if v is not None})


def test_a_start_from_a_model_folder_names_its_preset_by_the_digest():
    req = TrainRequest.from_args({**{k: v for k, v in BASE.items() if k != "preset"}, "init_from": "ef" * 32,
                                  "init_name": "gpt2"})
    assert req.preset == hf_preset("ef" * 32) == "hf-" + "ef" * 8
    assert "preset" not in req.to_args() and TrainRequest.from_args(req.to_args()) == req


KNOB_STARTS = [
    # (what, the operator's knobs, the allocation's TrainConfig, refused words)
    ("the same knobs", {}, CFG, None),
    ("another learning rate", {"lr": 0.5}, CFG, "in lr"),
    ("another batch and clipping", {"global_batch_seqs": 16, "grad_clip_norm": 2.0}, CFG,
     "in global_batch_seqs, grad_clip_norm"),
    ("the knobs, another allocation", {}, dataclasses.replace(CFG, wire_dtype="float16"), "in wire_dtype"),
    ("an fp32 start, a bf16 allocation", {}, dataclasses.replace(CFG, precision="bf16"), "in precision"),
    ("a bf16 start, its allocation", {"precision": "bf16"}, dataclasses.replace(CFG, precision="bf16"), None),
]


@pytest.mark.parametrize("what, knobs, train, words", KNOB_STARTS, ids=[k[0] for k in KNOB_STARTS])
def test_an_allocation_runs_the_knobs_the_operator_signed(what, knobs, train, words):
    a = alloc(train=train, operator_start=start_op(**knobs).encode())
    refusal = check_operator_start(a, OPERATORS)
    if words is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.code == "no-operator" and words in refusal.reason, refusal


# ---- the run-spec file ------------------------------------------------------------------------------


def test_a_run_spec_is_read_typed_and_flags_win(tmp_path):
    (tmp_path / "m").mkdir()
    f = tmp_path / "run.toml"
    f.write_text('steps = 300\nlr = 3e-4\nbatch = 32\nwire_dtype = "bfloat16"\nstages = 2\ninit_from = "m"\n')
    spec = load_run_spec(f)
    assert spec == {"steps": 300, "lr": 3e-4, "batch": 32, "wire_dtype": "bfloat16", "stages": 2,
                    "init_from": tmp_path / "m"}  # relative to the file's folder
    values = resolve({"steps": 50, "lr": None}, spec)
    assert (values["steps"], values["lr"], values["micro_batches"]) == (50, 3e-4, "auto")
    args = start_request(values)
    assert args == {"steps": 50, "seed": 0, "checkpoint_every": None, "placement": "scheduler", "stages": 2,
                    "lr": 3e-4, "global_batch_seqs": 32, "wire_dtype": "bfloat16", "micro_batches": "auto"}
    # the scheduler's choice is signed as such; a count given is signed as given
    assert start_request(resolve({"micro_batches": 4}, spec))["micro_batches"] == 4
    assert start_request(resolve({"preset": "small"}, spec))["preset"] == "small"  # the flag's model wins


@pytest.mark.parametrize("text, words", [
    ("lrr = 1\n", "unknown key 'lrr'; known: preset, init_from, steps"),
    ("[train]\nlr = 1\n", "unknown key 'train' (a table: a run spec's keys are top-level)"),
    ('lr = "fast"\n', "lr must be a number, got 'fast'"),
    ("steps = 1.5\n", "steps must be an integer, got 1.5"),
    ("steps = 0\n", "steps must be a positive integer, got 0"),
    ("stages = \"many\"\n", "stages must be an integer or \"auto\""),
    ('wire_dtype = "int8"\n', "wire_dtype 'int8': choose one of float32, float16, bfloat16"),
    ('preset = "huge"\n', "preset 'huge': choose one of"),
    ('preset = "tiny"\ninit_from = "x"\n', "preset and init_from both name the model"),
    ("steps = \n", "is not valid TOML"),
])
def test_a_bad_run_spec_is_named_and_the_command_exits_2(tmp_path, capsys, text, words):
    f = tmp_path / "run.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_run_spec(f)
    with pytest.raises(SystemExit) as e:
        peer_cli.main(["train", "start", "--data-dir", str(tmp_path), "--spec", str(f)])
    assert e.value.code == 2 and words.split("(")[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--lr", "0"], "argument --lr: must be positive"),
    (["--micro-batches", "x"], "argument --micro-batches: must be an integer"),
    (["--batch", "4", "--micro-batches", "8"], "global batch 4 is too small"),
    (["--dp", "2"], "needs --stages"),
    (["--init-from", "/nonexistent"], "--init-from (init_from): /nonexistent is not a folder"),
])
def test_bad_knob_flags_exit_2_before_anything_is_signed(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        peer_cli.main(["train", "start", "--data-dir", str(tmp_path), *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


# ---- the daemon: device, model folders, tokenizer -------------------------------------------------------


def test_the_daemon_config_checks_its_device_tokenizer_and_model_folders(tmp_path):
    assert PlaneSection().settings.device == "cpu"
    assert PlaneSection(device="cuda:1").settings.device == "cuda:1"
    with pytest.raises(ConfigError, match="plane.device .--device. 'gpu': choose cpu, cuda or cuda:N"):
        PlaneSection(device="gpu")
    with pytest.raises(ConfigError, match="plane.model_dirs .--model-dir. .*: no config.json there"):
        PlaneSection(model_dirs=(tmp_path,))
    with pytest.raises(ConfigError, match="plane.tokenizer .--tokenizer. .*: no such folder"):
        PlaneSection(tokenizer=tmp_path / "none")
    (tmp_path / "train.bin").write_bytes(bytes(8))
    with pytest.raises(ConfigError, match="is a token file, already tokenized"):
        PlaneSection(tokenizer=tmp_path, data=tmp_path / "train.bin")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_join_on_cuda_without_a_gpu_exits_2_with_the_reason(tmp_path, capsys):
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        peer_cli.check_device("cuda")
    with pytest.raises(SystemExit) as e:
        peer_cli.main(["join", "--data-dir", str(tmp_path), "--device", "cuda"])
    assert e.value.code == 2 and "--device) cuda: torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stage_from_a_model_folder_is_built_on_cuda(gpt2_folder):
    peer_cli.check_device("cuda")
    spec, _ = load_hf(gpt2_folder)
    state = hf_stage_state(gpt2_folder, TrainConfig(), (0, 2), device="cuda")
    assert state.device.type == "cuda" and state.spec == spec


# ---- model folders ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    return save_gpt2(tmp_path_factory.mktemp("hf") / "gpt2-test", n_positions=32, n_embd=32)


def test_a_peer_finds_the_folder_a_start_names_by_its_digest_or_says_why_not(gpt2_folder, caplog):
    held = load_held_models([str(gpt2_folder)])
    digest = hf_digest(gpt2_folder)
    name = hf_preset(digest)
    assert list(held) == [name] and held[name].digest == digest and held[name].spec.name == name
    assert held[name].spec.n_layer == 4 and held[name].spec.bias
    assert model_refusal(name, digest, "gpt2-test", held) is None
    why = model_refusal(hf_preset("0" * 64), "0" * 64, "other", held)
    assert why is not None and "model folder 'other' (sha256 000000000000), which this peer does not hold" in why
    assert "--model-dir DIR" in why
    assert load_held_models([str(gpt2_folder.parent), str(gpt2_folder)]) == held  # an unusable folder is left out
    assert "is left out" in caplog.text and "no config.json" in caplog.text

    spec = held[name].spec
    args = {"init_from": digest, "init_name": "gpt2-test", "steps": 100, "seed": 0, "checkpoint_every": 0,
            "data_hash": DATA}
    signed = sign_op(OPERATOR, "start", now_s=0.0, run_id=RUN, args={**args, **{k: getattr(CFG, k) for k in KNOBS}})
    a = alloc(preset=name, model=spec, layer_ranges=((0, 1), (1, 4)), operator_start=signed.encode())
    assert check_operator_start(a, OPERATORS) is None
    assert start_model(a, held) == held[name]
    assert start_model(alloc(), held) is None  # a preset's fresh weights
    with pytest.raises(ValueError, match="which this peer does not hold"):
        start_model(a, {})


@pytest.mark.parametrize("compress", ["exact", "diloco"])
def test_a_stage_built_from_a_folder_holds_its_layers_of_the_folder(gpt2_folder, compress):
    spec, params = load_hf(gpt2_folder)
    named = dataclasses.replace(spec, name="hf-x")
    comp = parse_compression(compress)
    state = hf_stage_state(gpt2_folder, TrainConfig(), (1, 4), spec=named, compression=comp)
    assert state.spec == named and state.compress.config == comp
    for n, p in state.params.items():
        assert torch.equal(p.detach(), params[n]), n
    if not comp.exact:  # DiLoCo's anchor is the folder's weights, not a random initialisation
        anchors = {k.removeprefix("compress/anchor/"): v for k, v in state.compress.state_tensors().items()
                   if k.startswith("compress/anchor/")}
        assert sorted(anchors) == sorted(state.params)
        assert all(torch.equal(anchors[n], params[n]) for n in anchors)
    with pytest.raises(ValueError, match="holds model"):
        hf_stage_state(gpt2_folder, TrainConfig(), (0, 4), spec=PRESETS["tiny"])



def test_a_peer_tokenizes_its_text_with_the_tokenizer_it_was_given_and_reads_token_files_as_they_are(tmp_path):
    from dtfm.control.models import load_peer_corpus
    from dtfm.train import load_token_file, load_tokenizer, write_token_file
    from dtfm.train.tokenizer import write_byte_tokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    write_byte_tokenizer(tok_dir)
    by_bytes = load_peer_corpus(str(text), None)
    tokenized = load_peer_corpus(str(text), str(tok_dir))
    assert tokenized.tokens.tolist() == load_tokenizer(tok_dir).encode(text.read_text()).tolist()
    assert tokenized.name.startswith(str(text)) and tokenized.name != by_bytes.name
    ids = (tokenized.tokens.astype("uint32") * 7) % 50257  # a GPT-2-sized vocabulary
    path = write_token_file(tmp_path / "train.uint32.bin", ids, "uint32")
    from_file = load_peer_corpus(str(path), None)
    assert from_file.fingerprint == load_token_file(path).fingerprint != tokenized.fingerprint
    assert from_file.tokens.tolist() == ids.tolist()


def test_train_start_signs_the_knobs_of_its_flags_and_spec_and_the_model_folder_by_digest(tmp_path, monkeypatch,
                                                                                           capsys, gpt2_folder):
    # What `dtfm-peer train start` hands its daemon: the operator's signed start, whose arguments
    # are the run spec's keys with the flags over them, and the model folder's digest, not its path.
    from dtfm.net import OperatorKey

    key = OperatorKey.create(tmp_path / "op.key")
    sent: list[dict] = []

    class Daemon:
        def __init__(self, *args, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def request(self, op, body):
            if op == "train_info":
                return {"operators": [key.public_key.hex()], "data_hash": DATA, "data_name": "d"}
            if op == "status":  # (the election term, read around the start)
                return {"training": {"term": 1}}
            sent.append(body)
            return {"steps": 7, "stages": 2, "dp": 1, "predicted_iteration_s": 1.0, "pipelines": [["ab" * 32] * 2],
                    "spares": [], "log": "x", "model": "hf-x"}

    monkeypatch.setattr(peer_cli, "ControlClient", Daemon)
    spec = tmp_path / "run.toml"
    spec.write_text(f'init_from = "{gpt2_folder}"\nsteps = 7\nlr = 0.01\nbatch = 8\nwire_dtype = "float16"\n')
    assert peer_cli.main(["train", "start", "--data-dir", str(tmp_path), "--operator-key", str(tmp_path / "op.key"),
                          "--spec", str(spec), "--lr", "0.02", "--micro-batches", "2"]) == 0
    op = SignedOp.from_wire(sent[0]["op"]).open()
    req = op.request()
    assert str(gpt2_folder) not in repr(op.args) and req.init_from == hf_digest(gpt2_folder)
    assert req.preset == hf_preset(req.init_from) and req.steps == 7 and req.init_name == "gpt2-test"
    assert req.config == TrainConfig(lr=0.02, global_batch_seqs=8, micro_batches=2, wire_dtype="float16")
    assert "training config: lr 0.02, global_batch_seqs 8, micro_batches 2, wire_dtype float16" in capsys.readouterr().out


class _Refused(Exception):
    def __init__(self, reason: str, code: str | None = None):
        super().__init__(reason)
        self.code = code


def _start_sender(terms: list[int | None], answers: list[object]):
    """A `send_start` whose daemon reports `terms` in turn and answers `answers` in turn (an
    exception is raised)."""
    from dtfm.peer.runspec import send_start
    said: list[str] = []
    sent = iter(answers)
    seen = iter(terms)

    def send():
        a = next(sent)
        if isinstance(a, Exception):
            raise a
        return a

    return (lambda: send_start(send, lambda: next(seen), (_Refused,), said.append)), said


def test_a_start_is_sent_again_when_an_election_deposed_its_coordinator():
    run, said = _start_sender([3, 4, 4], [_Refused("lost the connection"), "started"])
    assert run() == "started"
    assert len(said) == 1 and "term 3 -> 4" in said[0] and "(2 of 3)" in said[0]


@pytest.mark.parametrize("terms", [[0, 1], [None, 2], [5, 5], [5, None]], ids=["first-election", "unknown",
                                                                               "same-term", "no-answer"])
def test_a_failed_start_is_not_sent_again_without_a_deposition(terms):
    """The swarm's first election (term 0 -> 1) deposed no coordinator; nor did anything when
    the term stayed or the daemon did not say it."""
    run, said = _start_sender(terms, [_Refused("timed out"), "started"])
    with pytest.raises(_Refused, match="timed out"):
        run()
    assert said == []


@pytest.mark.parametrize("terms", [[0, 1, 1, 1], [None, None, None, None]], ids=["first-election", "unknown"])
def test_a_start_is_sent_again_when_the_daemon_says_its_coordinator_was_replaced(terms):
    """The refusal's code says it, where the terms cannot: the first election chose a
    coordinator that an election replaced before the run started, or the daemon did not say
    its term in time (a loaded machine)."""
    from dtfm.peer.control_client import DEPOSED
    run, said = _start_sender(terms, [_Refused("the allocation was refused", code=DEPOSED), "started"])
    assert run() == "started"
    assert len(said) == 1 and "the coordinator changed" in said[0] and "term" not in said[0].split("\n")[1]


def test_a_start_is_sent_at_most_start_attempts_times():
    from dtfm.peer.runspec import START_ATTEMPTS
    terms = [t for k in range(START_ATTEMPTS) for t in (k + 1, k + 2)]
    run, said = _start_sender(terms, [_Refused(f"deposed {k}") for k in range(START_ATTEMPTS)] + ["started"])
    with pytest.raises(_Refused, match=f"deposed {START_ATTEMPTS - 1}"):
        run()
    assert len(said) == START_ATTEMPTS - 1
