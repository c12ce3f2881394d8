"""Checkpoint files and the chunked, hash-verified stage transfer."""

from __future__ import annotations

import json

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.train import (CheckpointError, GPTSpec, StageState, TrainConfig, TransferError, TransferManifest,
                        TransferReceiver, checkpoint_at, checkpoint_notes, encode_transfer, list_checkpoints, load_checkpoint,
                        save_checkpoint, saved_checkpoints)

SPEC = GPTSpec("t", n_layer=4, n_embd=32, n_head=4, seq_len=16)
CFG = TrainConfig(global_batch_seqs=8, micro_batches=2)


def trained_state(layer_range=(1, 3)) -> StageState:
    st_ = StageState(SPEC, CFG, layer_range)
    for p in st_.params.values():
        p.grad = torch.full_like(p, 0.01)
    st_.optim.step(1e-2)
    st_.step = 1
    return st_


def assert_same(a: StageState, b: StageState) -> None:
    assert a.step == b.step and a.layer_range == b.layer_range
    assert a.optim.step_count == b.optim.step_count
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n])
        assert torch.equal(a.optim.exp_avg[n], b.optim.exp_avg[n])
        assert torch.equal(a.optim.exp_avg_sq[n], b.optim.exp_avg_sq[n])


def test_save_load_round_trip_and_keep_last_k(tmp_path):
    s = trained_state()
    for step in range(1, 6):
        s.step = step
        path = save_checkpoint(tmp_path, s, keep=2)
    kept = list_checkpoints(tmp_path, (1, 3))
    assert [p.name for p in kept] == ["step-00000004.json", "step-00000005.json"]
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "step-00000004.json", "step-00000004.safetensors", "step-00000005.json", "step-00000005.safetensors"]
    meta = json.loads(path.read_text())
    assert meta["step"] == 5 and meta["layer_range"] == [1, 3] and meta["spec"]["n_embd"] == 32
    assert_same(load_checkpoint(path), s)
    assert saved_checkpoints(tmp_path) == [(1, 3, 4), (1, 3, 5)]
    assert checkpoint_at(tmp_path, (1, 3), 5) == path and checkpoint_at(tmp_path, (1, 3), 3) is None
    (tmp_path / "notes").mkdir()  # not a stage folder: ignored
    assert saved_checkpoints(tmp_path) == [(1, 3, 4), (1, 3, 5)] and saved_checkpoints(tmp_path / "none") == []


def test_notes_are_kept_with_the_checkpoint(tmp_path):
    s = trained_state()
    plain = save_checkpoint(tmp_path, s)
    assert checkpoint_notes(plain) == {}
    s.step = 2
    noted = save_checkpoint(tmp_path, s, notes={"step_reports": [{"step": 1}]})
    assert checkpoint_notes(noted) == {"step_reports": [{"step": 1}]}
    assert_same(load_checkpoint(noted), s)
    noted.write_text("{")
    with pytest.raises(CheckpointError, match="cannot read"):
        checkpoint_notes(noted)


def test_corrupt_checkpoint_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, trained_state())
    blob = bytearray(path.with_suffix(".safetensors").read_bytes())
    blob[-1] ^= 1
    path.with_suffix(".safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "nope.json")


def test_transfer_round_trip_out_of_order_via_msgpack():
    s = trained_state((0, 2))
    manifest, chunks = encode_transfer(s, chunk_bytes=4096)
    assert len(chunks) > 3
    wire = msgpack.unpackb(msgpack.packb(manifest.to_wire()), raw=False)
    rx = TransferReceiver(TransferManifest.from_wire(wire, max_total_bytes=1 << 30))
    for i in reversed(range(len(chunks))):
        assert not rx.complete
        rx.feed(i, chunks[i])
    assert rx.complete
    assert_same(rx.finish(SPEC, CFG, (0, 2)), s)


def test_transfer_refuses_bad_chunks_and_keeps_going():
    manifest, chunks = encode_transfer(trained_state(), chunk_bytes=4096)
    rx = TransferReceiver(manifest)
    bad = bytearray(chunks[0])
    bad[10] ^= 0xFF
    with pytest.raises(TransferError, match="hash"):
        rx.feed(0, bytes(bad))
    with pytest.raises(TransferError, match="bytes"):
        rx.feed(0, chunks[0][:-1])
    with pytest.raises(TransferError, match="out of range"):
        rx.feed(len(chunks), chunks[0])
    with pytest.raises(TransferError, match="missing"):
        rx.finish(SPEC, CFG, (1, 3))
    for i, c in enumerate(chunks):  # a good copy from another holder still completes
        rx.feed(i, c)
    rx.finish(SPEC, CFG, (1, 3))


def test_stage_other_than_expected_is_refused():
    manifest, chunks = encode_transfer(trained_state(), chunk_bytes=1 << 20)
    rx = TransferReceiver(manifest)
    rx.feed(0, chunks[0])
    with pytest.raises(TransferError, match="expected layers"):
        rx.finish(SPEC, CFG, (0, 1))
    huge = GPTSpec("t", n_layer=4, n_embd=1 << 16, n_head=4, seq_len=16)  # never allocated
    with pytest.raises(TransferError, match="expected layers"):
        rx.finish(huge, CFG, (1, 3))


def test_description_that_lies_about_the_tensors_is_refused():
    manifest, chunks = encode_transfer(trained_state(), chunk_bytes=1 << 20)
    meta = dict(manifest.meta, layer_range=[0, 1])  # claims another stage: names will not fit
    rx = TransferReceiver(TransferManifest(meta, manifest.chunk_bytes, manifest.chunk_sha256))
    rx.feed(0, chunks[0])
    with pytest.raises(TransferError, match="missing or has the wrong shape"):
        rx.finish(SPEC, CFG, (0, 1))


def test_manifest_limits():
    manifest, _ = encode_transfer(trained_state())
    wire = manifest.to_wire()
    with pytest.raises(TransferError, match="stage size"):
        TransferManifest.from_wire(wire, max_total_bytes=100)
    with pytest.raises(TransferError, match="one hash per chunk"):
        TransferManifest.from_wire(dict(wire, chunk_sha256=[]), max_total_bytes=1 << 30)
    with pytest.raises(TransferError, match="chunk_bytes"):
        TransferManifest.from_wire(dict(wire, chunk_bytes=True), max_total_bytes=1 << 30)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["meta", "chunk_bytes", "chunk_sha256", "x"]),
                       _json | _json.map(json.dumps), max_size=4))
def test_garbage_manifest_raises_transfer_error_only(obj):
    with pytest.raises(TransferError):
        TransferManifest.from_wire(obj, max_total_bytes=1 << 20)


# ---- the bytes are safetensors' own, and a stage is copied at most once ------------------------

ST_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.int32,
             torch.float32, torch.float64, torch.int64]


def test_a_stage_encodes_to_safetensors_own_bytes_and_a_saved_file_to_the_same(tmp_path):
    from safetensors.torch import save as st_save

    from dtfm.train import encode_stage, stage_tensors

    state = trained_state()
    blob, meta = encode_stage(state)
    assert bytes(blob) == st_save({k: v.contiguous() for k, v in stage_tensors(state).items()})
    path = save_checkpoint(tmp_path, state)
    assert path.with_suffix(".safetensors").read_bytes() == bytes(blob)
    assert json.loads(path.read_text())["sha256"] == meta["sha256"]


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text("abc._/", min_size=1, max_size=6),
                       st.tuples(st.sampled_from(ST_DTYPES), st.lists(st.integers(0, 3), max_size=3)), max_size=6))
def test_safetensors_layout_and_parse_agree_with_safetensors(named):
    """Any names, dtypes and shapes (empty ones too): the same bytes as `safetensors.torch.save`,
    and parsed back (as views of a writable buffer) to the same tensors."""
    from safetensors.torch import save as st_save

    from dtfm.train.checkpoint import _bytes_of, _layout, parse_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(shape, generator=g) * 50).to(dt) for k, (dt, shape) in named.items()}
    header, items, _ = _layout(tensors)
    mine = header + b"".join(bytes(_bytes_of(t)) for _, t in items)
    assert mine == st_save(tensors)
    for blob in (bytearray(mine), mine):  # a view of a writable buffer, a copy of a read-only one
        back = parse_safetensors(blob)
        assert back.keys() == tensors.keys()
        for k, t in tensors.items():
            assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=64),
                 st.builds(lambda h, tail: len(h).to_bytes(8, "little") + h + tail,
                           st.recursive(st.none() | st.integers(-5, 300) | st.text(max_size=5),
                                        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                             max_size=3),
                                        max_leaves=12).map(lambda o: json.dumps(o).encode()),
                           st.binary(max_size=40)),
                 st.builds(lambda shape, offsets, dt, tail: (lambda h: len(h).to_bytes(8, "little") + h + tail)(
                     json.dumps({"x": {"dtype": dt, "shape": shape, "data_offsets": offsets}}).encode()),
                     st.lists(st.integers(-2, 5), max_size=3), st.lists(st.integers(-2, 40), max_size=3),
                     st.sampled_from(["F32", "I8", "BOOL", "F99", 7]), st.binary(max_size=40))))
def test_garbage_safetensors_raise_checkpoint_error_only(blob):
    from dtfm.train.checkpoint import parse_safetensors

    try:
        parse_safetensors(bytearray(blob))
    except CheckpointError:
        pass


def _numpy_and_bytes_peak(fn) -> int:
    """The peak bytes Python and numpy allocated while `fn` ran (tracemalloc sees both, and
    torch's own allocations not at all)."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_saving_encoding_and_receiving_a_stage_copy_it_at_most_once(tmp_path):
    """A checkpoint is written from the tensors (no blob of the stage), an offer's chunks are
    views of one blob, and a receiver holds the stage's bytes once and decodes views of them."""
    from dtfm.train import encode_stage

    state = StageState(GPTSpec("m", n_layer=2, n_embd=128, n_head=4, seq_len=16), CFG, (0, 2))
    nbytes = encode_stage(state)[0].nbytes  # about 1.6 MB
    assert _numpy_and_bytes_peak(lambda: save_checkpoint(tmp_path, state)) < nbytes // 10
    got = {}
    assert _numpy_and_bytes_peak(lambda: got.update(x=encode_transfer(state, 1 << 16))) < 1.1 * nbytes
    manifest, chunks = got.pop("x")
    assert all(isinstance(c, memoryview) and c.readonly for c in chunks)
    raw = [bytes(c) for c in chunks]
    del chunks

    def receive():
        rx = TransferReceiver(manifest)
        for i, c in enumerate(raw):
            rx.feed(i, c)
        got["tensors"] = rx.tensors()

    assert _numpy_and_bytes_peak(receive) < 1.1 * nbytes
    assert torch.equal(got["tensors"]["param/h.0.mlp.c_fc.weight"], state.params["h.0.mlp.c_fc.weight"].detach())
