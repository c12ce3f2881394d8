"""Export of a run (control/export.py): which step and stages are gathered, the holders'
answers checked, and the operator's signed export (control/operator.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.control import sign_op
from dtfm.control.export import ExportError, Held, choose_export, parse_held
from dtfm.control.operator import OperatorOp
from dtfm.net import OperatorKey, ProtocolError
from dtfm.train import PRESETS

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))
TINY_LAYERS = 4  # PRESETS["tiny"].n_layer


TINY = PRESETS["tiny"]


def held(*entries, spec=TINY):
    return Held(frozenset(entries), spec)


def test_the_newest_step_every_layer_is_held_at_is_exported():
    # Step 40: layers 0-2 only (the holder of 2-4 died before saving it); step 20 covers all,
    # from two layouts: the fewest stages that chain 0 -> 4 are taken, with every holder of each.
    plan = choose_export({A: held((0, 2, 20), (0, 2, 40)), B: held((2, 4, 20)), C: held((0, 2, 20), (2, 4, 20)),
                          D: held((0, 1, 20), (1, 4, 20))}, "r")
    assert plan.step == 20 and plan.spec == TINY
    assert plan.ranges == ((0, 1), (1, 4)) and plan.holders == {(0, 1): (D,), (1, 4): (D,)}
    plan = choose_export({A: held((0, 2, 20), (0, 2, 40)), B: held((2, 4, 20)), C: held((0, 2, 20), (2, 4, 20))}, "r")
    assert plan.step == 20 and plan.holders == {(0, 2): (A, C), (2, 4): (B, C)}


@pytest.mark.parametrize("peers, words", [
    ({}, "no live peer holds any stage of run r"),
    ({A: held((0, 2, 40), (0, 2, 20)), B: held((3, 4, 40))}, "at step 40, the newest, nobody holds layers 2-2"),
    ({A: held((0, 2, 4), spec=None)}, "no live peer holds any stage"),  # (a model nobody names)
    ({A: held((0, 4, 4), spec=PRESETS["small"]), B: held((0, 2, 8)), C: held((4, 12, 8), spec=PRESETS["small"])},
     "at step 8, the newest, nobody holds layers 0-3"),  # the model most holders name: small
    ({A: held()}, "no live peer holds any stage"),
])
def test_what_is_missing_is_named(peers, words):
    with pytest.raises(ExportError, match=words):
        choose_export(peers, "r")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, TINY_LAYERS - 1), st.integers(1, TINY_LAYERS), st.integers(0, 5)),
                max_size=12))
def test_a_chosen_plan_splits_the_model_at_one_step_held_by_the_peers_it_names(entries):
    entries = [(a, b, s) for a, b, s in entries if a < b]
    peers = {bytes([k + 1]) * 32: held(e) for k, e in enumerate(entries)}
    try:
        plan = choose_export(peers, "r")
    except ExportError:
        return
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == TINY_LAYERS
    assert all(x[1] == y[0] for x, y in zip(plan.ranges, plan.ranges[1:]))
    for r in plan.ranges:
        assert plan.holders[r] and all((*r, plan.step) in peers[p].entries for p in plan.holders[r])
    assert not any(s > plan.step and all(any((a, b, s) == e for e in entries) for a, b in plan.ranges)
                   for s in range(6))  # (no newer step held for the same split)


@pytest.mark.parametrize("answer", [
    5, {"held": 5}, {"held": [[0, 2]]}, {"held": [[0, 2, "4"]]}, {"held": [[2, 0, 4]]}, {"held": [[0, 2, -1]]},
    {"held": [[0, 2, 4]] * 65}, {"held": [], "spec": 7}, {"held": [], "spec": {"n_layer": "4"}},
    {"held": [], "spec": {**TINY.to_dict(), "evil": 1}}, {"held": [], "spec": {**TINY.to_dict(), "n_head": [1]}},
    {"held": [], "spec": {**TINY.to_dict(), "n_layer": 10**9}},
])
def test_a_malformed_holders_answer_is_a_protocol_error(answer):
    with pytest.raises(ProtocolError):
        parse_held(answer)


def test_a_holders_answer_is_read():
    assert parse_held({"held": [[0, 2, 4], [0, 2, 4]], "spec": TINY.to_dict()}) == held((0, 2, 4))


def test_an_export_names_the_one_peer_that_gathers_the_run():
    key = OperatorKey(b"\x07" * 32)
    op = sign_op(key, "export", now_s=1.0, run_id=b"r" * 16, args={"peer": A.hex()}).open()
    assert op.exporter() == A
    for args in ({}, {"peer": "zz" * 32}, {"peer": A.hex(), "out": "/tmp/x"}, {"peer": A.hex()[:10]}):
        with pytest.raises(ValueError, match="names the peer that gathers"):
            OperatorOp("export", key.public_key, b"r" * 16, 1000, args)
