"""Where a peer's stage of an allocation comes from (control/epoch/source.py's `stage_source`),
as a table: fresh weights, a model folder, its own copy (with the fetch to fall back on), or a
fetch of the old stages its layers need. The stage host only carries this decision out
(tests/control/epoch/test_recovery.py and tests/control/plane/test_plane_shell.py build, fetch and assemble for real)."""

from __future__ import annotations

import dataclasses

import pytest
from machine_trace import N, alloc

from dtfm.control.allocation import Holding
from dtfm.control.epoch.source import Fetch, FetchPart, Fresh, OwnCopy, needed_stages, replicas_differ, stage_source
from dtfm.train import parse_compression

D = "ab" * 32
H01 = Holding((0, 2), D, (N[0], N[2]))  # the old layout's stages: n0 and n2 hold 0-2, n1 and n3 hold 2-4
H24 = Holding((2, 4), D, (N[1], N[3]))
REPLICATED = dict(start_step=5, holdings=(H01, H24))


@pytest.mark.parametrize("me, kw, want", [
    # a new run from a preset: the run's seeded weights
    (N[0], {}, Fresh((0, 2))),
    (N[3], {}, Fresh((2, 4))),
    # the same layout again: each peer holds its own stage
    (N[0], REPLICATED, OwnCopy(H01, Fetch((0, 2), (FetchPart(H01, True),)))),
    (N[1], REPLICATED, OwnCopy(H24, Fetch((2, 4), (FetchPart(H24, True),)))),
    # pipelines swapped between DP groups: n0 now runs 2-4, which n1 and n3 hold
    (N[0], dict(REPLICATED, pipelines=((N[1], N[0]), (N[2], N[3]))), Fetch((2, 4), (FetchPart(H24, False),))),
    # one stage of the whole model, from both old stages; n0 holds the first of them
    (N[0], dict(REPLICATED, pipelines=((N[0],), (N[1],)), layer_ranges=((0, 4),)),
     Fetch((0, 4), (FetchPart(H01, True), FetchPart(H24, False)))),
    # re-split into 0-3 | 3-4: n1 takes 3-4 from H24 (its own), n0 takes 0-3 from both
    (N[1], dict(REPLICATED, layer_ranges=((0, 3), (3, 4))), Fetch((3, 4), (FetchPart(H24, True),))),
    (N[0], dict(REPLICATED, layer_ranges=((0, 3), (3, 4))),
     Fetch((0, 3), (FetchPart(H01, True), FetchPart(H24, False)))),
])
def test_where_a_stage_comes_from(me, kw, want):
    assert stage_source(alloc(**kw), me, {}) == want


def test_with_compressed_dp_a_peer_keeps_its_own_replica_of_any_stage_it_may_hold():
    # (each replica has its own residual: the holding's digest names one of them)
    a = alloc(**REPLICATED, compression=parse_compression("diloco"))
    assert replicas_differ(a) and not replicas_differ(alloc(**REPLICATED))
    moved = dataclasses.replace(a, pipelines=((N[1], N[0]), (N[2], N[3])))
    assert stage_source(moved, N[0], {}) == OwnCopy(H24, Fetch((2, 4), (FetchPart(H24, True),)))


def test_a_later_start_step_without_holders_cannot_be_built():
    with pytest.raises(ValueError, match="names no holders"):
        stage_source(alloc(start_step=5), N[0], {})


def test_a_run_from_a_model_folder_this_peer_does_not_hold_is_refused():
    a = alloc(preset="hf-" + "0" * 16)
    with pytest.raises(ValueError, match="not a built-in preset"):
        stage_source(a, N[0], {})


def test_needed_stages():
    old = [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert needed_stages(old, (0, 2)) == [0, 1]
    assert needed_stages(old, (1, 3)) == [1, 2]
    assert needed_stages(old, (2, 4)) == [2, 3]
    assert needed_stages([(0, 4)], (2, 3)) == [0]
