"""Hugging Face GPT-2 folders: dtfm's model exported and loaded by transformers, a GPT-2 built
by transformers imported into dtfm (whole and one stage at a time), trained in-process and
exported again, and sampled from. transformers is the oracle; nothing is downloaded."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

from dtfm.train import (GPTSpec, GPTStage, HFError, LocalCluster, Plan, TrainConfig, assemble, export_checkpoint_dir,
                        export_hf, hf_digest, hf_stage_state, load_corpus, load_hf, load_hf_spec, load_hf_stage,
                        sample_text, save_checkpoint, stage_param_names, stage_tensors)
from dtfm.train.cli import main
from dtfm.train.optim import clip_coefficient

TOL = 1e-5
TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 40)


def hf_logits(folder, x: torch.Tensor) -> torch.Tensor:
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(x).logits


def dtfm_logits(spec: GPTSpec, params: dict, x: torch.Tensor) -> torch.Tensor:
    model = GPTStage(spec, (0, spec.n_layer), seed=0)
    model.load_state_dict(params)
    with torch.no_grad():
        return model.eval()(x)


def random_biases(model: torch.nn.Module) -> None:
    """Non-zero biases and norm gains, so a mix-up of any of them shows in the logits."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or ".ln" in n or n.startswith("ln"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def small_gpt2(folder, **kw) -> GPT2LMHeadModel:
    """A GPT-2 built and saved by transformers itself (its own initialisation, gelu_new unless set)."""
    torch.manual_seed(0)
    cfg = GPT2Config(**{"vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 4, "n_head": 4,
                        "bos_token_id": 0, "eos_token_id": 0, **kw})
    model = GPT2LMHeadModel(cfg).eval()
    random_biases(model)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("tied,bias,activation", [(False, False, "gelu"), (True, True, "gelu_tanh"),
                                                  (True, False, "gelu"), (False, True, "gelu_tanh")])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tied, bias, activation):
    spec = GPTSpec("t", n_layer=3, n_embd=32, n_head=4, seq_len=16, vocab=64, tied_head=tied, bias=bias,
                   activation=activation)
    model = GPTStage(spec, (0, 3), seed=1).eval()
    random_biases(model)
    stages = [GPTStage(spec, r, seed=1) for r in ((0, 1), (1, 3))]  # the same weights, split in two
    for st in stages:
        st.load_state_dict({n: t for n, t in model.state_dict().items() if n in dict(st.named_parameters())})
    out = export_hf(spec, [st.state_dict() for st in stages], tmp_path / "model")
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no temporary folder left behind
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["activation_function"] == {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[activation]
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mine = model(x)
    assert (hf_logits(out, x) - mine).abs().max() < TOL
    back, params = load_hf(out)  # and back: the same spec (bias-free included), the same logits
    assert back == spec
    assert (dtfm_logits(back, params, x) - mine).abs().max() < TOL


def test_gpt2_built_by_transformers_imports_with_the_same_logits(tmp_path):
    hf = small_gpt2(tmp_path / "gpt2")
    spec, params = load_hf(tmp_path / "gpt2")
    assert (spec.activation, spec.tied_head, spec.bias, spec.vocab, spec.seq_len) == ("gelu_tanh", True, True, 256, 32)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(x).logits
    assert (dtfm_logits(spec, params, x) - want).abs().max() < TOL
    # One stage at a time, as each peer of a swarm loads only its layers: the chain is the model.
    h = x
    for rng in ((0, 1), (1, 3), (3, 4)):
        s, tensors = load_hf_stage(tmp_path / "gpt2", rng, spec)
        assert s == spec and sorted(tensors) == sorted(stage_param_names(spec, rng))
        stage = GPTStage(spec, rng, seed=0)
        stage.load_state_dict(tensors)
        with torch.no_grad():
            h = stage.eval()(h)
    assert (h - want).abs().max() < TOL


def test_openai_style_sharded_half_precision_files_import(tmp_path):
    """Keys without the `transformer.` prefix and with the old causal-mask buffers (as OpenAI's
    converted GPT-2 files have), float16 tensors, and two shards listed in an index."""
    hf = small_gpt2(tmp_path / "src")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_bytes((tmp_path / "src" / "config.json").read_bytes())
    sd = {k.removeprefix("transformer."): v.half().contiguous() for k, v in hf.state_dict().items()
          if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / "gpt2" / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "gpt2" / "model.safetensors.index.json").write_text(json.dumps(index))
    spec, params = load_hf(tmp_path / "gpt2")
    assert all(t.dtype == torch.float32 for t in params.values())
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    half = GPT2LMHeadModel.from_pretrained(tmp_path / "src").half().float().eval()  # the same rounding
    with torch.no_grad():
        want = half(x).logits
    assert (dtfm_logits(spec, params, x) - want).abs().max() < TOL
    assert load_hf_stage(tmp_path / "gpt2", (3, 4), spec)[1].keys() == {*stage_param_names(spec, (3, 4))}


def test_stage_param_names_are_what_the_stage_registers():
    for tied in (False, True):
        for bias in (False, True):
            spec = GPTSpec("t", n_layer=4, n_embd=8, n_head=2, seq_len=4, tied_head=tied, bias=bias)
            for rng in ((0, 4), (0, 1), (1, 3), (2, 4), (3, 4)):
                assert stage_param_names(spec, rng) == [n for n, _ in GPTStage(spec, rng, 0).named_parameters()]


def _hf_train(model: GPT2LMHeadModel, corpus, cfg: TrainConfig, steps: int) -> None:
    """dtfm's step in plain torch on the transformers model: mean loss of the global batch,
    global-norm clipping, AdamW with decay on matrices only."""
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if p.dim() >= 2]
    rest = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    model.train()
    for step in range(steps):
        x, y = corpus.batch(cfg.seed, step, range(cfg.global_batch_seqs), model.config.n_positions)
        opt.zero_grad()
        logits = model(x).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
        sq = sum(float(p.grad.double().pow(2).sum()) for p in params.values())
        for p in params.values():
            p.grad.mul_(clip_coefficient(sq, cfg.grad_clip_norm))
        opt.step()
    model.eval()


def test_import_train_in_process_export_matches_transformers(tmp_path):
    """A transformers GPT-2 imported stage by stage into 2 stages x 2 pipelines, trained 3 steps,
    exported: transformers loads it with dtfm's logits, and they match the same 3 steps taken on
    the transformers model itself."""
    hf = small_gpt2(tmp_path / "gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    (tmp_path / "data.txt").write_text(TEXT)
    corpus = load_corpus(tmp_path / "data.txt")
    cfg = TrainConfig(global_batch_seqs=8, micro_batches=2, lr=1e-3, grad_clip_norm=0.5, comm_timeout_s=20.0)
    spec = load_hf_spec(tmp_path / "gpt2")
    plan = Plan.grid(spec.n_layer, 2, 2)
    digest = hf_digest(tmp_path / "gpt2")
    states = {p: hf_stage_state(tmp_path / "gpt2", cfg, plan.layer_ranges[plan.position(p)[1]], spec, digest)
              for p in plan.peers}
    with LocalCluster(spec, cfg, plan, corpus, states=states) as cl:
        cl.run(3)
        stages = [cl.states[p] for p in plan.pipeline(0)]
        out = export_hf(spec, [stage_tensors(s) for s in stages], tmp_path / "trained")
        whole = assemble(spec, [s.module for s in stages]).eval()
    x, _ = corpus.batch(99, 0, range(4), spec.seq_len)
    with torch.no_grad():
        mine = whole(x)
    assert (hf_logits(out, x) - mine).abs().max() < TOL
    _hf_train(hf, corpus, cfg, 3)
    with torch.no_grad():
        theirs = hf(x).logits
    assert (theirs - mine).abs().max() < TOL
    assert (hf_logits(tmp_path / "gpt2", x) - mine).abs().max() > 1e-2  # training did change the model


def test_checkpoints_export_and_the_newest_common_step(tmp_path):
    spec = GPTSpec("t", n_layer=2, n_embd=16, n_head=2, seq_len=8)
    cfg = TrainConfig(global_batch_seqs=4, micro_batches=2)
    (tmp_path / "data.txt").write_text(TEXT)
    plan = Plan.grid(2, 2, 1)
    with LocalCluster(spec, cfg, plan, load_corpus(tmp_path / "data.txt")) as cl:
        cl.run(1)
        for p in plan.peers:
            save_checkpoint(tmp_path / "ck", cl.states[p])
        cl.run(1)
        save_checkpoint(tmp_path / "ck", cl.states[plan.peers[0]])  # step 2 of the first stage only
        want = assemble(spec, [cl.states[p].module for p in plan.peers])
    out = export_checkpoint_dir(tmp_path / "ck", tmp_path / "m")  # step 1: the newest both stages have
    _, params = load_hf(out)
    assert not torch.equal(params["h.0.attn.c_attn.weight"], want.state_dict()["h.0.attn.c_attn.weight"])
    with pytest.raises(HFError, match="do not cover"):
        export_checkpoint_dir(tmp_path / "ck", tmp_path / "m2", step=2)
    with pytest.raises(HFError, match="exists"):
        export_checkpoint_dir(tmp_path / "ck", tmp_path / "m")
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "m"), "--force"]) == 0


def _write_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "llama"}, "only the GPT-2 family"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"n_inner": 48}, "not a multiple"),
    ({"n_embd": 30}, "not divisible"),
])
def test_foreign_configs_are_refused_with_the_reason(tmp_path, changes, message):
    small_gpt2(tmp_path)
    _write_config(tmp_path, **changes)
    with pytest.raises(HFError, match=message):
        load_hf(tmp_path)


def test_missing_or_pickled_weights_and_mismatches_are_refused(tmp_path):
    with pytest.raises(HFError, match="no config.json"):
        load_hf(tmp_path)
    small_gpt2(tmp_path)
    spec = load_hf_spec(tmp_path)
    with pytest.raises(HFError, match="the run trains"):
        load_hf_stage(tmp_path, (0, 2), GPTSpec("other", n_layer=4, n_embd=32, n_head=4, seq_len=32))
    with pytest.raises(HFError, match="digest"):
        hf_stage_state(tmp_path, TrainConfig(), (0, 2), spec, digest="0" * 64)
    with pytest.raises(HFError, match="layer range"):
        load_hf_stage(tmp_path, (2, 9))
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(HFError, match="pickled"):
        load_hf(tmp_path)


def test_export_is_atomic_and_refuses_an_existing_folder(tmp_path):
    spec = GPTSpec("t", n_layer=2, n_embd=16, n_head=2, seq_len=8)
    model = GPTStage(spec, (0, 2), seed=0)
    export_hf(spec, model.state_dict(), tmp_path / "m")
    with pytest.raises(HFError, match="exists"):
        export_hf(spec, model.state_dict(), tmp_path / "m")
    with pytest.raises(HFError, match="missing"):
        export_hf(spec, GPTStage(spec, (0, 1), seed=0).state_dict(), tmp_path / "n")
    assert sorted(os.listdir(tmp_path)) == ["m"]
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    export_hf(spec, model.state_dict(), tmp_path / "m", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["m"]
    assert torch.equal(load_hf(tmp_path / "m")[1]["wte.weight"], model.wte.weight)


def test_greedy_sample_is_transformers_greedy_generation(tmp_path, capsys):
    hf = small_gpt2(tmp_path / "gpt2")
    spec, params = load_hf(tmp_path / "gpt2")
    out = export_hf(spec, params, tmp_path / "m")  # the byte tokenizer: the model trains on bytes
    prompt = "def "
    text = sample_text(out, prompt, 12, temperature=0)
    ids = torch.tensor([list(prompt.encode())])
    want = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    assert list(text.encode("utf-8", errors="replace"))[:len(prompt)] == list(prompt.encode())
    assert text == bytes(want).decode("utf-8", errors="replace")
    assert main(["sample", "--model", str(out), "--prompt", prompt, "--tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == text + "\n"
    a = sample_text(out, prompt, 20, temperature=1.0, top_k=5, seed=3)
    assert a == sample_text(out, prompt, 20, temperature=1.0, top_k=5, seed=3)


def test_sample_errors_are_one_line(tmp_path, capsys):
    assert main(["sample", "--model", str(tmp_path), "--prompt", "x", "--tokens", "2"]) == 1
    assert "error: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["sample", "--model", str(tmp_path), "--prompt", "x", "--tokens", "0"])
    assert e.value.code == 2


def test_cli_trains_from_a_folder_and_exports(tmp_path, capsys):
    small_gpt2(tmp_path / "gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    (tmp_path / "data.txt").write_text(TEXT)
    args = ["--init-from", str(tmp_path / "gpt2"), "--data", str(tmp_path / "data.txt"), "--steps", "2",
            "--stages", "2", "--batch", "4", "--micro-batches", "2", "--quiet", "--export", str(tmp_path / "out")]
    assert main(args) == 0
    spec, params = load_hf(tmp_path / "out")
    assert spec == load_hf_spec(tmp_path / "gpt2")
    assert main(args) == 1  # the export folder exists now: refused before training
    assert "exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args[:2] + ["--preset", "tiny"])
