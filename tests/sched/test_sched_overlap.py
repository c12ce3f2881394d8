"""The simulator with a DiLoCo exchange overlapping the next inner steps (`overlap_steps`): the
synchronising step pays its coding and only the part of the exchange the overlapped steps do
not hide, in closed form; the codec carries the field from the run's config and reads a stored
codec written before it."""

import dataclasses

import numpy as np
import pytest

from dtfm.sched import (WIRE_PRESETS, CodecAssignment, CodecSpeed, CompressionOptions, CostModel, DataParallelCodec,
                        Workload, simulate_iteration, wire_codecs)
from dtfm.train.compress import parse_compression

DILOCO = WIRE_PRESETS["diloco"][1]
SPEED = CodecSpeed(sparse_encode_ns_per_elem=20.0, sparse_decode_ns_per_elem=5.0)


def one_stage(delay_ms: float, overlap: int, speed: CodecSpeed = SPEED):
    """One stage, two pipelines 0 and 1 (the DP pair), 0.3 s of compute per micro-batch, 2 of them."""
    delay = np.array([[0.0, delay_ms], [delay_ms, 0.0]])
    bw = np.array([[np.inf, 1.0], [1.0, np.inf]])
    wl = Workload(stages=1, dp=2, layers=1, grad_gb_total=0.1, act_gb=0.0, micro_batches=2, layer_compute_s=0.3)
    codec = dataclasses.replace(DILOCO, overlap_steps=overlap)
    m = CostModel(delay, bw, wl, compression=CompressionOptions(dp=(DataParallelCodec(), codec), speed=speed))
    return simulate_iteration(m, np.array([[0, 1]]), codecs=CodecAssignment((), (codec,)))


def test_the_codec_carries_the_overlap():
    assert wire_codecs(parse_compression("slow-link,dp_overlap_steps=2"))[1].overlap_steps == 2
    assert wire_codecs(parse_compression("slow-link"))[1].overlap_steps == 0
    assert DataParallelCodec("exact", overlap_steps=3) == DataParallelCodec()
    assert DataParallelCodec("cocktail", 0.1, 0.2, 4, 1024, 1, 3).overlap_steps == 0
    assert "overlapping 1" in dataclasses.replace(DILOCO, overlap_steps=1).name
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError):
            dataclasses.replace(DILOCO, overlap_steps=bad)
    # an assignment stored before the field existed reads as no overlap
    stored = CodecAssignment.uniform(1, 2, dp_codec=DILOCO).to_dict()
    for c in stored["dp_codecs"]:
        c.pop("overlap_steps")
    assert CodecAssignment.from_dict(stored, 1, 2).dp == (DILOCO,)


@pytest.mark.parametrize("delay_ms", [10.0, 2000.0])  # hidden behind one local step, and longer than one
@pytest.mark.parametrize("overlap", [1, 2])
def test_an_overlapped_sync_pays_its_coding_and_what_the_overlap_does_not_hide(delay_ms, overlap):
    waits = one_stage(delay_ms, 0)
    over = one_stage(delay_ms, overlap)
    local = 2 * 0.3  # two micro-batches of 0.3 s, nothing else on a step without a sync
    sync = waits.allreduce_s[0]
    assert waits.iteration_s == pytest.approx(local + sync / 16)
    numel = 0.1e9 / 4
    coding = numel * (20.0 + 2 * 5.0) * 1e-9
    exposed = coding + max(sync - coding - overlap * local, 0.0)
    assert over.allreduce_s == waits.allreduce_s  # the exchange itself takes as long
    assert over.exposed_sync_s[0] == pytest.approx(exposed)
    assert over.iteration_s == pytest.approx(local + exposed / 16)
    assert over.iteration_s < waits.iteration_s
    if delay_ms > 1000:  # longer than the overlapped steps: only they are saved
        assert over.exposed_sync_s[0] == pytest.approx(sync - overlap * local)


def test_without_coding_cost_a_hidden_exchange_is_free():
    r = one_stage(10.0, 1, CodecSpeed())
    assert r.exposed_sync_s == (0.0,) and r.iteration_s == pytest.approx(0.6)


def test_the_local_step_is_reported():
    waits, over = one_stage(10.0, 0), one_stage(10.0, 1)
    assert waits.local_iteration_s == pytest.approx(0.6) and over.local_iteration_s == pytest.approx(0.6)
