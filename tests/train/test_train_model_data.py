"""Model split and initialisation, presets, batch split and deterministic sampling."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.sched import CostModel, Workload
from dtfm.train import (PRESETS, ByteTokenizer, GPTSpec, GPTStage, Plan, TrainConfig, get_preset, load_corpus,
                        split_batch)

SPEC = GPTSpec("t", n_layer=4, n_embd=32, n_head=4, seq_len=16)


def _counts(ranges) -> list[int]:
    assert ranges[0][0] == 0
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    return [b - a for a, b in ranges]


def _slowest(counts, speeds) -> float:
    return max(c / w for c, w in zip(counts, speeds))


@settings(max_examples=200)
@given(st.integers(1, 12), st.data())
def test_grid_split_is_contiguous_and_min_max_optimal(n_layer, data):
    """Every stage gets a contiguous, non-empty range, and no other split of the layers makes
    the slowest stage (layers / speed) faster: checked against all splits."""
    stages = data.draw(st.integers(1, min(n_layer, 4)))
    speeds = data.draw(st.none() | st.lists(st.floats(0.1, 10), min_size=stages, max_size=stages))
    ranges = Plan.grid(n_layer, stages, 1, speeds).layer_ranges
    counts = _counts(ranges)
    assert ranges[-1][1] == n_layer and len(ranges) == stages and min(counts) >= 1
    w = speeds or [1.0] * stages
    best = min(_slowest([b - a for a, b in zip((0,) + cut, cut + (n_layer,))], w)
               for cut in itertools.combinations(range(1, n_layer), stages - 1))
    assert _slowest(counts, w) == best
    if speeds is None:
        assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


@settings(max_examples=50)
@given(st.integers(1, 48), st.data())
def test_grid_split_is_the_split_the_scheduler_costs(n_layer, data):
    stages = data.draw(st.integers(1, min(n_layer, 6)))
    speeds = data.draw(st.lists(st.floats(0.1, 10), min_size=stages, max_size=stages))
    wl = Workload(stages=stages, dp=1, layers=n_layer, grad_gb_total=1.0, act_gb=0.1, layer_compute_s=1.0)
    dl, bw = np.full((stages, stages), 10.0), np.full((stages, stages), 1.0)
    X = np.arange(stages).reshape(stages, 1)  # peer s runs stage s, at speeds[s]
    costed = CostModel(dl, bw, wl, compute=np.array(speeds), uneven_layers=True).breakdown(X).layers
    assert tuple(_counts(Plan.grid(n_layer, stages, 1, speeds).layer_ranges)) == costed
    even = CostModel(dl, bw, wl).breakdown(X).layers
    assert tuple(_counts(Plan.grid(n_layer, stages, 2).layer_ranges)) == even


def test_grid_split_follows_speeds_and_refuses_the_impossible():
    assert Plan.grid(8, 2, 1, [3, 1]).layer_ranges == ((0, 6), (6, 8))
    assert Plan.grid(5, 3, 1, [1, 3, 1]).layer_ranges == ((0, 1), (1, 4), (4, 5))
    assert Plan.grid(2, 2, 1, [1, 100]).layer_ranges == ((0, 1), (1, 2))  # at least one layer each
    with pytest.raises(ValueError, match="cannot split"):
        Plan.grid(2, 3, 1)
    for bad in ([1.0], [1.0, 0.0], [1.0, float("nan")], [1.0, -2.0]):
        with pytest.raises(ValueError, match="speeds"):
            Plan.grid(4, 2, 1, bad)


def test_stages_compose_to_the_whole_model():
    torch.manual_seed(123)  # global RNG must not matter
    whole = GPTStage(SPEC, (0, 4), seed=7)
    parts = [GPTStage(SPEC, r, seed=7) for r in [(0, 1), (1, 3), (3, 4)]]
    names = {n for p in parts for n, _ in p.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}
    for p in parts:
        for n, t in p.named_parameters():
            assert torch.equal(t, whole.get_parameter(n)), n
    x = torch.randint(0, 256, (2, 16))
    h = x
    for p in parts:
        h = p(h)
    torch.testing.assert_close(h, whole(x), rtol=1e-5, atol=1e-6)


def test_init_depends_on_seed_and_layer():
    a, b = GPTStage(SPEC, (0, 4), seed=1), GPTStage(SPEC, (0, 4), seed=2)
    w = "h.1.mlp.c_fc.weight"
    assert not torch.equal(a.get_parameter(w), b.get_parameter(w))
    assert not torch.equal(a.get_parameter("h.1.mlp.c_fc.weight"), a.get_parameter("h.2.mlp.c_fc.weight"))


def test_last_stage_returns_loss_and_logits():
    last = GPTStage(SPEC, (2, 4), seed=0)
    h = torch.randn(3, 16, 32)
    assert last(h).shape == (3, 16, 256)
    loss = last(h, torch.randint(0, 256, (3, 16)))
    assert loss.shape == () and 4.0 < float(loss.detach()) < 7.0  # about ln 256 at init


def test_presets_and_param_count():
    assert set(PRESETS) == {"tiny", "small", "gpt3-xl"}
    xl = get_preset("gpt3-xl")
    assert 1.2e9 < xl.params < 1.5e9
    tiny = GPTStage(PRESETS["tiny"], (0, PRESETS["tiny"].n_layer), seed=0)
    assert sum(p.numel() for p in tiny.parameters()) == PRESETS["tiny"].params
    tied = dataclasses.replace(SPEC, tied_head=True, bias=True)
    assert sum(p.numel() for p in GPTStage(tied, (0, 4), 0).parameters()) == tied.params
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("huge")
    with pytest.raises(ValueError):
        GPTSpec("bad", n_layer=2, n_embd=30, n_head=4, seq_len=8)


def test_train_config_validation():
    with pytest.raises(ValueError, match="wire_dtype"):
        TrainConfig(wire_dtype="int8")
    with pytest.raises(ValueError):
        TrainConfig(lr=0)
    assert TrainConfig.from_dict(TrainConfig(seed=5).to_dict()).seed == 5


@given(st.integers(1, 200), st.integers(1, 8), st.integers(1, 8))
def test_split_batch_every_sample_once(b, d, m):
    if b < d * m:
        with pytest.raises(ValueError):
            split_batch(b, d, m)
        return
    parts = split_batch(b, d, m)
    seen = [i for pipe in parts for r in pipe for i in r]
    assert seen == list(range(b))
    assert all(len(r) >= 1 for pipe in parts for r in pipe)


def test_plan_validation_and_groups():
    plan = Plan.grid(6, 3, 2)
    assert plan.dp_group(1) == ("peer0.1", "peer1.1")
    assert plan.position("peer1.2") == (1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        Plan((("a", "b"),), ((0, 2), (3, 4)))
    with pytest.raises(ValueError, match="only one stage"):
        Plan((("a", "a"),), ((0, 1), (1, 2)))


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=64 << 10)


def test_default_corpus_is_stdlib_source(corpus):
    assert "stdlib" in corpus.name
    assert b"import" in corpus.tokens.tobytes()
    assert len(corpus.fingerprint) == 64


def test_sampling_depends_only_on_seed_step_and_index(corpus):
    x, y = corpus.batch(3, 10, range(0, 8), 16)
    assert x.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = corpus.batch(3, 10, range(4, 8), 16)  # another pipeline's share: same samples
    assert torch.equal(x2, x[4:])
    assert not torch.equal(corpus.batch(3, 11, range(0, 8), 16)[0], x)
    assert not torch.equal(corpus.batch(4, 10, range(0, 8), 16)[0], x)


def test_data_from_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("second file " * 10)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 50)
    folder = load_corpus(tmp_path)
    assert folder.tokens.tobytes() == b"hello world, " * 20 + b"\n" + b"second file " * 10
    assert load_corpus(tmp_path / "a.txt").tokens.tobytes() == b"hello world, " * 20
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="too few"):
        load_corpus(tmp_path / "a.txt").batch(0, 0, range(1), 1000)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve 🐍 code\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab == 256


def test_assemble_and_generate():
    from dtfm.train import assemble, generate

    parts = [GPTStage(SPEC, r, seed=3) for r in [(0, 2), (2, 4)]]
    whole = assemble(SPEC, parts, seed=99)  # weights come from the parts, not the seed
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(whole(x), parts[1](parts[0](x)), rtol=1e-5, atol=1e-6)
    out = generate(whole, torch.tensor([1, 2, 3]), 20, generator=torch.Generator().manual_seed(0))
    again = generate(whole, torch.tensor([1, 2, 3]), 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (23,) and torch.equal(out, again) and torch.equal(out[:3], torch.tensor([1, 2, 3]))
    assert generate(whole, torch.tensor([5]), 20, temperature=0).shape == (21,)  # longer than seq_len
    with pytest.raises(ValueError, match="cover"):
        assemble(SPEC, parts[:1])
    with pytest.raises(ValueError, match="whole model"):
        generate(parts[0], torch.tensor([1]), 1)
