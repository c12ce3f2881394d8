"""The plane's input layer (control/inputs.py): every body a peer sends the plane is checked
there once, into the typed event a machine takes or the request the shell answers; anything
malformed raises ProtocolError and nothing else. Peers' answers to the coordinator are typed
once too, by what was asked (control/answers.py). The daemon's shell, the simulation and the
coordinator's fixture call the same functions, and none of them checks a body itself."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from machine_trace import KEYS, N, OPERATOR, RUN, alloc, report

from dtfm.control import ControlMsg, PeerRunState, SignedAllocation, answers, inputs, sign_op
from dtfm.control.coordinator.machine import StepFailed, StepReported
from dtfm.control.epoch.machine import StartAsked, StopAsked
from dtfm.control.reach import ReachAnswer, ReachRequest
from dtfm.net import ProtocolError
from paths import ROOT

KEY = ("k", 1)
OTHER = b"o" * 16


# ---- STOP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, current, want", [
    ({"run": RUN, "at_step": 7}, RUN, StopAsked(KEY, N[1], RUN, 7)),
    # another run's STOP: its step is not read (it stops nothing here)
    ({"run": OTHER, "at_step": "x"}, RUN, StopAsked(KEY, N[1], OTHER, 0)),
    ({"run": RUN, "at_step": 7}, None, StopAsked(KEY, N[1], RUN, 0)),
    ({"run": RUN, "at_step": 3, "final": True, "abort": 1, "epoch": 2}, RUN,
     StopAsked(KEY, N[1], RUN, 3, final=True, abort=False, epoch=2)),
])
def test_a_stop_becomes_the_epoch_machine_s_event(body, current, want):
    assert inputs.stop_asked(KEY, N[1], body, current_run=current, coordinator=N[1]) == (want, None)


@pytest.mark.parametrize("body, why", [
    ([1, 2], "STOP body must be a map"),
    ({"run": RUN, "at_step": -1}, "at_step must be a non-negative integer"),
    ({"run": RUN, "at_step": True}, "at_step must be a non-negative integer"),
    ({"run": RUN}, "at_step must be a non-negative integer"),
    ({"run": RUN, "at_step": 1, "epoch": -2}, "epoch must be a non-negative integer"),
    ({"run": OTHER, "epoch": False}, "epoch must be a non-negative integer"),
    ({"run": RUN, "at_step": 1, "op": "not an op"}, ""),
    ({"run": RUN, "at_step": 1, "cert": {"term": "x"}}, ""),
])
def test_a_malformed_stop_is_refused(body, why):
    with pytest.raises(ProtocolError, match=why or None):
        inputs.stop_asked(KEY, N[1], body, current_run=RUN, coordinator=N[1])


def test_an_operator_s_stop_carries_its_signed_operation():
    op = sign_op(OPERATOR, "stop", now_s=1.0, run_id=RUN)
    ev, _ = inputs.stop_asked(KEY, N[0], {"run": RUN, "at_step": 4, "final": True, "op": op.to_wire()},
                              current_run=RUN, coordinator=N[0])
    assert ev.op == op and ev.final


@pytest.mark.parametrize("sender, coordinator, learnt", [
    (N[1], N[2], True),  # a coordinator this peer does not recognise yet: the election checks its certificate
    (N[1], None, True),
    (N[1], N[1], False),  # the one it recognises: nothing to learn
])
def test_the_certificate_to_learn_is_one_of_a_sender_not_recognised_as_coordinator(sender, coordinator, learnt):
    cert = object()
    assert (inputs.to_learn(cert, sender, coordinator) is cert) is learnt  # type: ignore[arg-type]
    assert inputs.to_learn(None, sender, coordinator) is None


# ---- START, STEP, ALLOCATION, LEAVE, TRAIN_OP --------------------------------------------------


def test_a_start_becomes_the_epoch_machine_s_event():
    assert inputs.start_asked(KEY, N[1], {"run": RUN, "epoch": 3}) == StartAsked(KEY, N[1], RUN, 3)
    with pytest.raises(ProtocolError, match="START body must be a map"):
        inputs.start_asked(KEY, N[1], b"x")


def test_a_step_message_is_a_report_or_a_failure():
    rep = report(1, 5, loss=2.5)
    assert inputs.step_message(N[1], {"run": RUN, **rep.to_wire()}) == StepReported(N[1], RUN, rep)
    assert inputs.step_message(N[2], {"run": RUN, "epoch": 1, "failed": "oom"}) == StepFailed(N[2], RUN, 1, "oom")
    for bad, why in (([], "STEP body must be a map"), ({"failed": 3}, "STEP failed must be a string"),
                     ({"run": RUN, "epoch": 1}, "")):
        with pytest.raises(ProtocolError, match=why or None):
            inputs.step_message(N[1], bad)


def test_an_allocation_is_opened_with_its_certificate_and_a_bad_one_answered():
    a = alloc()
    body = SignedAllocation.sign(a, KEYS[N.index(a.issuer)]).to_wire()
    assert inputs.signed_allocation(body) == (a, None)
    forged = dict(body, sig=bytes(64))
    with pytest.raises(ProtocolError) as e:
        inputs.signed_allocation(forged)
    assert inputs.bad_allocation(e.value) == answers.AllocationAnswer(False, "bad-allocation", str(e.value))
    with pytest.raises(ProtocolError):
        inputs.signed_allocation("not a map")


def test_leave_and_forwarded_operations():
    inputs.leave_request({})
    with pytest.raises(ProtocolError):
        inputs.leave_request([])
    assert inputs.train_op({"op": "stop"}) == inputs.TrainOp("stop", None)
    with pytest.raises(ProtocolError, match="unknown op"):
        inputs.train_op({"op": "format-disk"})


# ---- RUN_STATE --------------------------------------------------------------------------------


@pytest.mark.parametrize("body, want", [
    ({"op": "query"}, inputs.Query()),
    ({"op": "progress", "after": 3}, inputs.Progress(None, 3)),
    ({"op": "progress", "run": RUN, "after": -1}, inputs.Progress(RUN, -1)),
    ({"op": "keep", "run": RUN}, inputs.Keep(RUN)),
    ({"op": "reach", "peers": [N[2]], "timeout_s": 1.0}, ReachRequest((N[2],), 1.0)),
    ({"op": "offer", "run": RUN, "step": 4, "layers": [0, 2]}, inputs.Offer(RUN, 4, (0, 2), frozenset())),
    ({"op": "offer", "run": RUN, "step": 4, "layers": [0, 2], "for": [N[3]]},
     inputs.Offer(RUN, 4, (0, 2), frozenset({N[3]}))),
])
def test_run_state_requests_are_typed(body, want):
    assert inputs.run_state_request(N[1], body, coordinator=N[1]) == want


def test_an_export_keeps_its_body_for_the_exporter_to_check():
    body = {"op": "export", "run": RUN}
    assert inputs.run_state_request(N[1], body, coordinator=None) == inputs.Export(body)


@pytest.mark.parametrize("body, why", [
    ("x", "RUN_STATE"),
    ({"op": "dance"}, "unknown op"),
    ({"op": "progress", "after": 2**62 + 1}, ""),
    ({"op": "keep", "run": b"short"}, ""),
    ({"op": "offer", "run": RUN, "step": -1, "layers": [0, 2]}, ""),
    ({"op": "offer", "run": RUN, "step": 1, "layers": [0]}, "layers must be"),
    ({"op": "offer", "run": RUN, "step": 1, "layers": [0, True]}, "layers must be"),
    ({"op": "offer", "run": RUN, "step": 1, "layers": [0, 2], "for": [b"x"]}, ""),
    ({"op": "reach", "peers": [N[2]], "timeout_s": 0.0}, "timeout_s must be positive"),
])
def test_a_malformed_run_state_request_is_refused(body, why):
    with pytest.raises(ProtocolError, match=why or None):
        inputs.run_state_request(N[1], body, coordinator=N[1])


# ---- garbage in, ProtocolError out ------------------------------------------------------------

WIRE = st.recursive(st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.binary(max_size=40)
                    | st.text(max_size=12) | st.sampled_from([RUN, N[1], "offer", "query", "progress", "keep",
                                                              "reach", "stop", "failed", "stage", "spare", "busy",
                                                              "ab" * 32]),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["op", "run", "step", "layers", "for", "at_step", "epoch", "final",
                                         "abort", "cert", "failed", "after", "peers", "timeout_s", "signed",
                                         "body", "sig", "loss", "accepted", "code", "reason", "error", "role",
                                         "stage", "pipeline", "fetched_bytes", "fetch_s", "started", "stopped",
                                         "digest", "bytes"]), inner, max_size=6), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(body=WIRE)
def test_any_body_gives_a_typed_input_or_a_protocol_error(body):
    calls = [
        lambda: inputs.start_asked(KEY, N[1], body),
        lambda: inputs.stop_asked(KEY, N[1], body, current_run=RUN, coordinator=N[2]),
        lambda: inputs.step_message(N[1], body),
        lambda: inputs.signed_allocation(body),
        lambda: inputs.run_state_request(N[1], body, coordinator=N[2]),
        lambda: inputs.leave_request(body),
        lambda: inputs.train_op(body),
    ]
    for call in calls:
        try:
            call()
        except ProtocolError:
            pass


# ---- one copy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["control/plane.py", "control/testing/sim.py", "tests/coordinator_fixtures.py"])
def test_the_shells_check_bodies_only_through_the_input_layer(path):
    """No shell parses a STOP, STEP, RUN_STATE or ALLOCATION body itself: the checks are the
    input layer's alone, so the simulation runs the daemon's own."""
    source = (ROOT / path).read_text()
    assert "inputs." in source
    for copy in ('"at_step"', 'body.get("failed")', "SignedAllocation.from_wire", "coordinator_certificate(",
                 'get_str(d, "op"', "Certificate.from_wire", "StepReport.from_wire"):
        assert copy not in source, f"{path} checks a body itself: {copy}"


# ---- peers' answers -------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [
    # the epoch machine's answers, as it writes them (control/epoch/machine.py)
    answers.AllocationAnswer(True, role="stage", stage=1, pipeline=0, fetched_bytes=4096, fetch_s=0.5),
    answers.AllocationAnswer(True, role="stage", stage=0, pipeline=2),
    answers.AllocationAnswer(True, role="spare"),
    answers.AllocationAnswer.refused("build-failed", "replaced while building"),
    answers.StartAnswer(True),
    answers.StartAnswer(False, "only the issuer starts an epoch"),
    answers.StopAnswer(True),
    answers.StopAnswer(False, "not in that run"),
    answers.OfferAnswer("ab" * 32, 1 << 20),
    answers.OfferAnswer(None, reason="not held here"),
])
def test_answers_round_trip(answer):
    assert type(answer).from_wire(answer.to_wire()) == answer


def test_answers_read_untrusted_maps_as_the_coordinator_does():
    no_answer = {"reason": "no answer within 5 s"}  # (a map without the asked field)
    assert answers.AllocationAnswer.from_wire(no_answer) == answers.AllocationAnswer(False, None, no_answer["reason"])
    assert answers.AllocationAnswer.from_wire({"accepted": False, "code": "Not A Code!"}).code == "malformed"
    assert answers.AllocationAnswer.from_wire({"accepted": True, "fetched_bytes": -3, "fetch_s": True}) == \
        answers.AllocationAnswer(True)
    assert answers.AllocationAnswer.from_wire({"accepted": 1, "role": "stage", "stage": 1, "pipeline": "0",
                                              "fetched_bytes": 7.0, "code": "x"}) == \
        answers.AllocationAnswer(True, role="stage", stage=1, fetched_bytes=7)
    assert answers.StopAnswer.from_wire(no_answer) == answers.StopAnswer(False, no_answer["reason"])
    assert answers.StartAnswer.from_wire({"started": True}).started
    assert answers.OfferAnswer.from_wire({"digest": "AB" * 32, "bytes": 5}) == answers.OfferAnswer(None)
    assert answers.OfferAnswer.from_wire({"error": "x" * 9999}).reason == "x" * answers.MAX_REASON
    assert answers.refusal_code(None) is None and answers.refusal_code("busy") == "busy"


@settings(max_examples=300, deadline=None)
@given(body=WIRE)
def test_any_answer_reads_as_a_typed_answer(body):
    for cls in (answers.AllocationAnswer, answers.StartAnswer, answers.StopAnswer, answers.OfferAnswer):
        answer = cls.from_wire(body)
        assert cls.from_wire(answer.to_wire()) == answer


@pytest.mark.parametrize("cls, wire", [
    # what peers send today (control/epoch/machine.py, control/epoch/stages.py): read and written
    # back, the same map
    (answers.AllocationAnswer, {"accepted": True, "role": "stage", "stage": 1, "pipeline": 0, "fetched_bytes": 0,
                               "fetch_s": 0.0}),
    (answers.AllocationAnswer, {"accepted": True, "role": "spare"}),
    (answers.AllocationAnswer, {"accepted": False, "code": "bad-allocation", "reason": "bad signature"}),
    (answers.StartAnswer, {"started": True}),
    (answers.StartAnswer, {"started": False, "reason": "no such epoch accepted here"}),
    (answers.StopAnswer, {"stopped": True}),
    (answers.StopAnswer, {"stopped": False, "reason": "not in that run"}),
    (answers.OfferAnswer, {"digest": "0f" * 32, "bytes": 123}),
    (answers.OfferAnswer, {"error": "not held here"}),
])
def test_the_wire_answers_peers_send_today_are_read_and_written_unchanged(cls, wire):
    assert cls.from_wire(wire).to_wire() == wire


# ---- answers typed by what was asked (control/answers.py `read_answers`) ---------------------

QUERY = {"op": "query"}
REACH = ReachRequest((N[1], N[2]), 1.0).to_wire()
OFFER = {"op": "offer", "run": RUN, "step": 2, "layers": [0, 2], "for": []}
KEEP = {"op": "keep", "run": RUN}
STATE = PeerRunState(RUN, 1, 1, (0, 2), 2, None, True)
REQUESTS = [(ControlMsg.ALLOCATION, {}), (ControlMsg.START, {"run": RUN, "epoch": 1}),
            (ControlMsg.STOP, {"run": RUN, "at_step": 2}), (ControlMsg.RUN_STATE, QUERY),
            (ControlMsg.RUN_STATE, REACH), (ControlMsg.RUN_STATE, OFFER), (ControlMsg.RUN_STATE, KEEP)]


@pytest.mark.parametrize("msg, body, reply, want", [
    (ControlMsg.ALLOCATION, {}, {"accepted": True, "role": "spare"}, answers.AllocationAnswer(True, role="spare")),
    (ControlMsg.START, {}, {"started": True}, answers.StartAnswer(True)),
    (ControlMsg.STOP, {}, {"stopped": False, "reason": "not in that run"}, answers.StopAnswer(False, "not in that run")),
    (ControlMsg.STOP, {}, {"started": True}, answers.StopAnswer(False)),  # the answer to another request: no stop
    (ControlMsg.RUN_STATE, QUERY, STATE.to_wire(), STATE),
    (ControlMsg.RUN_STATE, QUERY, {"error": "not a peer of the run"}, answers.NoAnswer("refused: not a peer of the run")),
    (ControlMsg.RUN_STATE, QUERY, {"running": "yes"}, answers.Malformed("run state: run must be 16 bytes or empty")),
    (ControlMsg.RUN_STATE, REACH, {"reached": [N[1]], "unreached": [N[2]]}, ReachAnswer((N[1],), (N[2],))),
    # a reach answered with a refusal is none (the probe reads the peer as silent); one whose
    # lists do not read is an answer with nothing learnt from it
    (ControlMsg.RUN_STATE, REACH, {"error": "only the coordinator asks"}, answers.NoAnswer("refused: only the coordinator asks")),
    (ControlMsg.RUN_STATE, REACH, [1, 2], answers.NoAnswer("no reach answer")),
    (ControlMsg.RUN_STATE, REACH, {"reached": "x"}, answers.Malformed("reached must be a list of at most 4096 peer ids")),
    (ControlMsg.RUN_STATE, OFFER, {"digest": "0f" * 32, "bytes": 3}, answers.OfferAnswer("0f" * 32, 3)),
    (ControlMsg.RUN_STATE, OFFER, {"error": "not held here"}, answers.OfferAnswer(None, reason="not held here")),
    (ControlMsg.RUN_STATE, KEEP, {"kept": [[0, 2, 4]]}, answers.KeepAnswer(True)),
    (ControlMsg.RUN_STATE, KEEP, {"error": "busy"}, answers.KeepAnswer(False, "busy")),
    # the shell's own no-answer stays one, whatever was asked
    (ControlMsg.ALLOCATION, {}, answers.NoAnswer("no answer within 5 s"), answers.NoAnswer("no answer within 5 s")),
    (ControlMsg.RUN_STATE, QUERY, answers.NoAnswer("unreachable: closed"), answers.NoAnswer("unreachable: closed")),
])
def test_an_answer_is_typed_by_what_was_asked(msg, body, reply, want):
    assert answers.read_answer(msg, body, reply) == want


@settings(max_examples=200, deadline=None)
@given(reply=WIRE)
def test_any_reply_to_any_request_reads_as_its_typed_answer_without_raising(reply):
    kinds = {ControlMsg.ALLOCATION: answers.AllocationAnswer, ControlMsg.START: answers.StartAnswer,
             ControlMsg.STOP: answers.StopAnswer}
    ops = {"query": (PeerRunState, answers.NoAnswer, answers.Malformed),
           "reach": (ReachAnswer, answers.NoAnswer, answers.Malformed),
           "offer": answers.OfferAnswer, "keep": answers.KeepAnswer}
    for msg, body in REQUESTS:
        got = answers.read_answers(msg, body, {N[1]: reply})[N[1]]
        assert isinstance(got, kinds[msg] if msg in kinds else ops[body["op"]])


def test_a_request_without_a_typed_answer_is_a_bug_of_the_asker():
    with pytest.raises(ValueError):
        answers.read_answer(ControlMsg.RUN_STATE, {"op": "progress"}, {})
    with pytest.raises(ValueError):
        answers.read_answer(ControlMsg.TRAIN_OP, {}, {})


@pytest.mark.parametrize("path", ["control/plane.py", "control/testing/sim.py", "tests/coordinator_fixtures.py"])
def test_the_shells_type_answers_only_through_read_answers(path):
    """Each shell hands the coordinator the answers `read_answers` typed, and makes a peer
    that did not answer a `NoAnswer`, never a map of its own."""
    source = (ROOT / path).read_text()
    assert "Answers(" in source and "read_answers(" in source
    assert "NoAnswer(" in source
    assert '{"reason": f"no answer' not in source


def test_no_part_of_the_coordinator_reads_an_answer_as_a_map():
    """The coordinator's parts take `PeerAnswer`s: none decodes a wire answer itself."""
    for path in sorted((ROOT / "control" / "coordinator").glob("*.py")):
        source = path.read_text()
        for copy in ("from_wire(", "Mapping[bytes, dict]", 'a.get("', "answer.get("):
            assert copy not in source, f"{path.name} reads an answer as a map: {copy}"
