"""Observing a self-healing swarm without daemons: the status table and its coordinator, the
logs merged from every coordinator's data dir, `dtfm-swarm events`, the report's
reconfigurations, and `dtfm-peer status` / `train reschedule` rendering."""

import json
import os
import tempfile
import time
from types import SimpleNamespace
from pathlib import Path

import pytest
import trio

from dtfm import files
from dtfm.control import SignedOp, check_op
from dtfm.net import OperatorKey
from dtfm.peer.cli import format_reschedule
from dtfm.peer.cli import main as peer_main
from dtfm.peer.config import SocketConfig
from dtfm.peer.control_client import DEPOSED, ControlClientError
from dtfm.peer.socket import ControlServer
from dtfm.peer.paths import DataDir
from dtfm.peer.status import format_status_text, format_text, format_training
from dtfm.swarm import cli as swarm_cli
from dtfm.swarm import report as report_mod
from dtfm.swarm import runreport
from dtfm.swarm import train as train_mod
from dtfm.swarm import proc as proc_mod
from dtfm.swarm.report import format_event, format_reconfigurations, format_status, pick_coordinator, status_report
from dtfm.swarm.state import PeerEntry, SwarmError, SwarmState, save_state
from dtfm.swarm.train import merge_events, merge_train, read_log, run_end, sync_logs, wait_step, write_jsonl

ID = {name: (f"{k:x}" * 64)[:64] for k, name in enumerate(["p00", "p01", "p02", "p03", "p04", "p05"], start=10)}


def make_state(tmp_path: Path, regions=("eu", "us", "eu", "us", "eu", "asia")) -> SwarmState:
    state = SwarmState(scenario="worldwide", scenario_name="worldwide", time_scale=1.0, bandwidth_scale=0.05)
    for k, region in enumerate(regions):
        name = f"p{k:02d}"
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        state.peers.append(PeerEntry(name=name, index=k, region=region, port=7000 + k,
                                     data_dir=str(tmp_path / name), peer_id=ID[name]))
    return state


def training(stage=None, pipeline=None, role=None, term=None, coordinator=None, state="training", **more):
    t = {"state": state, "epoch": 2 if stage is not None else None, "stage": stage, "pipeline": pipeline,
         "step": 17 if stage is not None else None, "role": role, "term": term, "coordinator": coordinator}
    t.update(more)
    return {k: v for k, v in t.items() if v is not None}


# A 2 x 2 run over p00..p03 coordinated by p03 in term 5; p04 a spare, p05 idle (older daemon).
STATUSES = {
    "p00": training(1, 0, "follower", 5, ID["p03"]),
    "p01": training(0, 1, "follower", 5, ID["p03"]),
    "p02": training(0, 0, "follower", 5, ID["p03"]),
    "p03": training(1, 1, "coordinator", 5, ID["p03"], issued={"state": "training", "completed": 17,
                                                               "started_at": 100.0}),
    "p04": {"state": "accepted", "role": "spare", "term": 5, "coordinator": ID["p03"], "epoch": 2},
    "p05": {"state": "idle"},
}


@pytest.fixture
def fake_status(monkeypatch):
    statuses = dict(STATUSES)

    def peer_status(peer):
        t = statuses.get(peer.name)
        return None if t is None else {"peer_id": ID[peer.name], "training": t}

    monkeypatch.setattr(report_mod, "peer_status", peer_status)
    monkeypatch.setattr(train_mod, "peer_status", peer_status)
    return statuses


# ---- status ---------------------------------------------------------------------------------

def test_status_json_has_role_term_and_one_coordinator(tmp_path, fake_status):
    rep = status_report(make_state(tmp_path))
    peers = {p["name"]: p for p in rep["peers"]}
    assert [p["name"] for p in rep["peers"]] == [f"p{k:02d}" for k in range(6)]  # scenario order kept
    assert rep["coordinator"] == "p03" and rep["term"] == 5
    assert [n for n, p in peers.items() if p["coordinator"]] == ["p03"]
    assert peers["p03"]["role"] == "coordinator" and peers["p00"]["role"] == "follower"
    assert peers["p04"]["role"] == "spare" and peers["p05"]["role"] is None
    assert peers["p00"]["term"] == 5 and peers["p05"]["term"] is None
    assert peers["p00"]["sees_coordinator"] == ID["p03"]
    assert (peers["p00"]["stage"], peers["p00"]["pipeline"], peers["p00"]["step"]) == (1, 0, 17)
    json.dumps(rep)


def test_status_table_groups_by_region_then_stage_and_marks_the_coordinator(tmp_path, fake_status):
    text = format_status(status_report(make_state(tmp_path)))
    lines = text.splitlines()
    assert "coordinator p03* (term 5)" in lines[0]
    header = lines[1].split()
    assert header[:5] == ["REGION", "NAME", "ID", "ROLE", "TERM"]
    rows = [line.split() for line in lines[2:8]]
    # asia; eu: stage 0/0 (p02), 1/0 (p00), then the spare p04; us: 0/1 (p01), 1/1 (p03)
    assert [(r[0], r[1]) for r in rows] == [("asia", "p05"), ("eu", "p02"), ("eu", "p00"), ("eu", "p04"),
                                            ("us", "p01"), ("us", "p03*")]
    by_name = {r[1]: r for r in rows}
    assert by_name["p03*"][3:6] == ["coordinator", "5", "1/1"]
    assert by_name["p04"][3:6] == ["spare", "5", "-"]
    assert by_name["p05"][3:6] == ["-", "-", "-"]
    assert sum("*" in r[1] for r in rows) == 1


def test_idle_peers_come_after_the_training_ones_of_their_region(tmp_path, fake_status):
    fake_status["p02"] = {"state": "idle"}
    rows = [line.split() for line in format_status(status_report(make_state(tmp_path))).splitlines()[2:8]]
    assert [r[1] for r in rows if r[0] == "eu"] == ["p00", "p02", "p04"]


def test_no_coordinator_known_says_so(tmp_path, fake_status):
    for name in STATUSES:
        fake_status[name] = {"state": "stopped", "role": "candidate", "term": 6}
    rep = status_report(make_state(tmp_path))
    assert rep["coordinator"] is None and rep["term"] == 6
    assert not any(p["coordinator"] for p in rep["peers"])
    assert "no coordinator known (term 6)" in format_status(rep).splitlines()[0]


@pytest.mark.parametrize("peers, trainings, want", [
    # two claim to coordinate (a deposed one has not heard yet): the higher term wins
    ([{"id": "aa", "role": "coordinator", "term": 3}, {"id": "bb", "role": "coordinator", "term": 4}], [{}, {}], 1),
    # the coordinator is dead: the peer most recognise at the highest term is marked
    ([{"id": "aa" * 32, "role": "follower", "term": 4, "sees_coordinator": "bb" * 32},
      {"id": "bb" * 32, "term": None}, {"id": "cc" * 32, "role": "follower", "term": 3,
                                        "sees_coordinator": "aa" * 32}], [{}, {}, {}], 1),
    # older daemons without an election: the issuer of the latest run
    ([{"id": "aa"}, {"id": "bb"}, {"id": "cc"}],
     [{"issued": {"started_at": 5.0}}, {}, {"issued": {"started_at": 9.0}}], 2),
    ([{"id": "aa"}, {"id": "bb"}], [{}, {}], None),
])
def test_pick_coordinator(peers, trainings, want):
    assert pick_coordinator(peers, trainings) == want


# ---- merging the logs -------------------------------------------------------------------------

def step(k, term, epoch=1, **more):
    return {"step": k, "loss": 5.0 - k / 10 + term / 1000, "epoch": epoch, "term": term,
            "iteration_s": 0.5, "time": 1000.0 + k + term, **more}


def test_overlapping_lines_of_two_coordinators_give_contiguous_steps_with_the_later_term():
    old = [step(k, 3) for k in range(8)]                        # coordinator of term 3, died after step 7
    new = [step(k, 4) for k in range(5, 8)] + [step(k, 4, epoch=2) for k in range(8, 12)]  # back-filled 5..7
    for sources in ([old, new], [new, old]):
        merged = merge_train(sources)
        assert [r["step"] for r in merged] == list(range(12))
        assert [r["term"] for r in merged] == [3] * 5 + [4] * 7
    # epoch breaks a tie of terms; a line without a step is left out
    merged = merge_train([[step(3, 4, epoch=1)], [step(3, 4, epoch=2)], [{"loss": 1.0}]])
    assert [(r["step"], r["epoch"]) for r in merged] == [(3, 2)]


def test_events_are_deduplicated_and_sorted_by_time():
    a = [{"time": 10.0, "event": "coordinator", "term": 1}, {"time": 30.0, "event": "reconfigure", "term": 1}]
    b = [{"time": 20.0, "event": "coordinator", "term": 2}, {"time": 30.0, "event": "reconfigure", "term": 1},
         {"time": 40.0, "event": "reconfigure", "term": 2}]
    merged = merge_events([b, a, b])
    assert [(e["time"], e["event"], e["term"]) for e in merged] == [
        (10.0, "coordinator", 1), (20.0, "coordinator", 2), (30.0, "reconfigure", 1), (40.0, "reconfigure", 2)]
    assert merge_events([merged]) == merged  # idempotent


def test_write_jsonl_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"step": 0}])
    assert read_log(path) == [{"step": 0}]

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_jsonl(path, [{"step": 0}, {"step": 1}])
    assert read_log(path) == [{"step": 0}]  # the old file, whole
    assert sorted(os.listdir(tmp_path)) == ["train.jsonl"]  # no temporary file left behind


def test_read_log_skips_a_half_written_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"step": 0}\n\n{"step": 1}\n{"step": 2, "lo')
    assert read_log(path) == [{"step": 0}, {"step": 1}]
    assert read_log(tmp_path / "missing.jsonl") == []


def test_sync_logs_merges_every_data_dir_into_the_run_dir(tmp_path):
    state = make_state(tmp_path)
    write_jsonl(tmp_path / "p01" / "train.jsonl", [step(k, 3) for k in range(6)])  # dead by now: still read
    write_jsonl(tmp_path / "p03" / "train.jsonl", [step(k, 4) for k in range(4, 9)])
    write_jsonl(tmp_path / "p01" / "events.jsonl", [{"time": 1.0, "event": "coordinator", "term": 3}])
    write_jsonl(tmp_path / "p03" / "events.jsonl", [{"time": 2.0, "event": "coordinator", "term": 4},
                                                    {"time": 3.0, "event": "reconfigure", "term": 4}])
    rows, events = sync_logs(tmp_path, state)
    assert [(r["step"], r["term"]) for r in rows] == [(k, 3) for k in range(4)] + [(k, 4) for k in range(4, 9)]
    assert read_log(tmp_path / "train.jsonl") == rows
    assert [e["time"] for e in read_log(tmp_path / "events.jsonl")] == [1.0, 2.0, 3.0] == [e["time"] for e in events]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_sync_logs_leaves_out_earlier_runs(tmp_path):
    state = make_state(tmp_path)
    # run 1 was coordinated by p00; run 2 (this one) by p02, whose file holds only its steps
    write_jsonl(tmp_path / "p00" / "train.jsonl", [{"step": k, "term": 9, "epoch": 1, "time": 100.0 + k}
                                                   for k in range(10)])
    write_jsonl(tmp_path / "p00" / "events.jsonl", [{"time": 50.0, "event": "coordinator", "term": 9},
                                                    {"time": 105.0, "event": "reconfigure", "term": 9},
                                                    {"time": 106.0, "event": "stepped-down", "term": 9}])
    write_jsonl(tmp_path / "p02" / "train.jsonl", [{"step": k, "term": 9, "epoch": 1, "time": 500.0 + k,
                                                    "run": "ab" * 16} for k in range(3)]
                + [{"step": 3, "term": 9, "epoch": 1, "time": 504.0, "run": "cd" * 16}])
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "ab" * 16, "started_at": 400.0}))
    rows, events = sync_logs(tmp_path, state)
    assert [r["time"] for r in rows] == [500.0, 501.0, 502.0]
    assert [e["event"] for e in events] == ["coordinator", "stepped-down"]  # elections kept, old reconfigurations not


def test_wait_follows_a_coordinator_change(tmp_path, fake_status, monkeypatch):
    state = make_state(tmp_path)
    write_jsonl(tmp_path / "p03" / "train.jsonl", [step(k, 5) for k in range(3)])
    polls = []

    def sleep(_):  # between polls: p03 dies after step 3, p01 takes over in term 6 and goes on
        polls.append(len(polls))
        if len(polls) == 1:
            write_jsonl(tmp_path / "p03" / "train.jsonl", [step(k, 5) for k in range(4)])
            for name in fake_status:
                fake_status[name] = {"state": "stopped", "role": "candidate", "term": 6}
            fake_status.pop("p03")
        elif len(polls) == 2:
            write_jsonl(tmp_path / "p01" / "train.jsonl", [step(k, 6) for k in range(2, 7)])

    monkeypatch.setattr(train_mod.time, "sleep", sleep)
    last = wait_step(state, tmp_path, 6, timeout_s=60, settle_s=0.0)
    assert last["step"] == 6 and last["term"] == 6
    rows = read_log(tmp_path / "train.jsonl")
    assert [(r["step"], r["term"]) for r in rows] == [(0, 5), (1, 5)] + [(k, 6) for k in range(2, 7)]


def test_wait_counts_steps_from_1_as_the_step_lines_do(tmp_path, fake_status, monkeypatch, capsys):
    from dtfm.swarm.state import save_state
    save_state(tmp_path, make_state(tmp_path))
    write_jsonl(tmp_path / "p03" / "train.jsonl", [step(k, 5) for k in range(3)])  # indices 0..2: 3 steps
    monkeypatch.setattr(train_mod.time, "sleep", lambda _: None)
    assert swarm_cli.main(["wait", "--run-dir", str(tmp_path), "--step", "3", "--timeout", "5"]) == 0
    assert "step 3 completed" in capsys.readouterr().err
    assert swarm_cli.main(["wait", "--run-dir", str(tmp_path), "--step", "0", "--timeout", "5"]) == 0  # merges only
    assert swarm_cli.main(["wait", "--run-dir", str(tmp_path), "--step", "4", "--timeout", "0.001"]) == 1
    assert "step 4 not reached within 0.001 s (last completed step 3" in capsys.readouterr().err


def test_wait_gives_up_when_the_run_ended(tmp_path, fake_status, monkeypatch):
    state = make_state(tmp_path)
    write_jsonl(tmp_path / "p03" / "train.jsonl", [step(k, 5) for k in range(3)])
    for name in list(fake_status):
        fake_status[name] = {"state": "stopped", "role": "follower", "term": 5}
    fake_status["p03"] = {"state": "stopped", "role": "coordinator", "term": 5,
                          "issued": {"state": "stopped", "completed": 2, "reason": "stage 1 is held nowhere"}}
    monkeypatch.setattr(train_mod.time, "sleep", lambda _: None)
    with pytest.raises(SwarmError, match="stage 1 is held nowhere; step 11 not reached"):
        wait_step(state, tmp_path, 10, timeout_s=60, settle_s=0.0)


def test_wait_gives_up_when_the_council_lost_its_quorum(tmp_path, fake_status, monkeypatch):
    state = make_state(tmp_path)
    write_jsonl(tmp_path / "p03" / "train.jsonl", [step(k, 5) for k in range(3)])
    election = {"role": "pre-candidate", "term": 5, "voters": 5, "quorum": 4, "live_voters": 3,
                "gone_voters": [ID["p04"], ID["p05"]]}
    for name in ("p00", "p01", "p02", "p03"):
        fake_status[name] = {**fake_status[name], "election": election}
    monkeypatch.setattr(train_mod.time, "sleep", lambda _: None)
    with pytest.raises(SwarmError, match=r"council lost its quorum: 3 of 5 voters alive, 4 needed "
                                         r"\(gone: p04, p05\).*; step 11 not reached"):
        wait_step(state, tmp_path, 10, timeout_s=60, settle_s=0.0)


@pytest.mark.parametrize("statuses, events, want", [
    ([{"training": {"state": "training"}}], [], None),
    ([{"training": {"state": "stopped", "role": "candidate"}},
      {"training": {"issued": {"state": "finished", "completed": 9}}}], [], None),  # an election runs
    ([{"training": {"state": "stopped"}}], [{"time": 1, "event": "stopped", "term": 2, "epoch": 3,
                                            "trigger": "no resume point"}],
     "training stopped (term 2, epoch 3): no resume point"),
    ([{"training": {"state": "finished", "issued": {"state": "finished", "completed": 9}}}], [],
     "training finished: all 10 steps done"),
    # the coordinator's record wins over an older issuer's
    ([{"training": {"state": "stopped", "issued": {"state": "finished", "completed": 9, "started_at": 9.0}}},
      {"training": {"state": "stopped", "role": "coordinator", "term": 3,
                    "issued": {"state": "refused", "completed": -1, "reason": "no", "started_at": 1.0}}}], [],
     "training refused after 0 steps: no"),
    ([{"training": {"state": "idle"}}, {}], [], None),
    # an election after the stop does not resume the run; a reconfiguration after it does
    ([{"training": {"state": "stopped"}}], [{"time": 1, "event": "stopped", "trigger": "t", "term": 1, "epoch": 1},
                                            {"time": 2, "event": "coordinator", "term": 2}],
     "training stopped (term 1, epoch 1): t"),
    ([{"training": {"state": "stopped"}}], [{"time": 1, "event": "stopped", "trigger": "t"},
                                            {"time": 2, "event": "reconfigure", "term": 2}], None),
    # seen live: the new coordinator (a "spare" of the run) wrote that the run cannot go on
    ([{"training": {"state": "spare", "role": "coordinator"}}, {"training": {"state": "stopped"}}],
     [{"time": 1, "event": "stopped", "term": 3, "epoch": 2, "trigger": "coordinator changed (term 3)",
       "reason": "no reachable peer holds layers 0-1"}],
     "training stopped (term 3, epoch 2): coordinator changed (term 3): no reachable peer holds layers 0-1"),
])
def test_run_end(statuses, events, want):
    assert run_end(statuses, events) == want


# ---- events and the report -----------------------------------------------------------------

EVENTS = [
    {"time": 1000.0, "event": "coordinator", "term": 1, "epoch": 1, "trigger": "train start"},
    {"time": 1060.5, "event": "reconfigure", "term": 2, "epoch": 2, "trigger": "peer 3fa2c1d0 is dead",
     "old_shape": "2x4", "new_shape": "2x3", "predicted_old_s": 1.25, "predicted_new_s": 1.5,
     "moves": 2, "bytes_moved": 12_500_000, "resume_step": 41},
]


def test_format_event_says_everything_in_one_line():
    line = format_event(EVENTS[1], t0=1000.0)
    assert line == ("+60.5s  reconfigure  term 2  epoch 2  peer 3fa2c1d0 is dead  2x4 -> 2x3  "
                    "predicted 1.250 s -> 1.500 s  2 moves  12.5 MB moved  resumed after step 41")
    assert format_event({"event": "stopped"}) == "?  stopped  term -  epoch -"
    # as the coordinator writes them: the writer, the plan's kind, a stop's reason
    stopped = {"time": 1070.0, "event": "stopped", "peer": "ab" * 32, "term": 3, "epoch": 4,
               "trigger": "peer 77aa0011 is dead", "reason": "layers (0, 2) are held nowhere"}
    assert format_event(stopped, t0=1000.0) == ("+70.0s  stopped  term 3  epoch 4  peer 77aa0011 is dead  "
                                                "layers (0, 2) are held nowhere  by abababab")
    assert format_event({**EVENTS[1], "kind": "reshape"}).endswith("resumed after step 41  (reshape)")
    start = {"time": 1000.0, "event": "start", "term": 1, "epoch": 1, "trigger": "train start", "old_shape": None,
             "new_shape": "2x2", "predicted_new_s": 0.017, "moves": 0, "bytes_moved": 0, "resume_step": 0}
    assert format_event(start, t0=1000.0) == ("+0.0s  start  term 1  epoch 1  train start  - -> 2x2  "
                                              "predicted 0.017 s  0 moves  0 B moved  resumed from its first step")


def test_events_command(tmp_path, capsys):
    state = make_state(tmp_path)
    save_state(tmp_path, state)
    write_jsonl(tmp_path / "p00" / "events.jsonl", [EVENTS[0]])
    write_jsonl(tmp_path / "p02" / "events.jsonl", [EVENTS[1], EVENTS[0]])
    assert swarm_cli.main(["events", "--run-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "  coordinator  term 1  epoch 1  train start" in lines[0]
    assert lines[1].endswith("reconfigure  term 2  epoch 2  peer 3fa2c1d0 is dead  2x4 -> 2x3  "
                             "predicted 1.250 s -> 1.500 s  2 moves  12.5 MB moved  resumed after step 41")
    assert swarm_cli.main(["events", "--run-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == EVENTS
    assert read_log(tmp_path / "events.jsonl") == EVENTS


def test_events_command_without_events(tmp_path, capsys):
    save_state(tmp_path, make_state(tmp_path))
    assert swarm_cli.main(["events", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "no events yet" in out.err


def _run_dir_of_a_finished_run(tmp_path: Path, events=EVENTS) -> SwarmState:
    """What a stopped swarm leaves: swarm.json, run.json, train.jsonl, events.jsonl (no daemon)."""
    state = make_state(tmp_path)
    save_state(tmp_path, state)
    rows = [step(k, 1, tokens_per_s=1000.0 + k, predicted_iteration_s=0.4) for k in range(60)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "events.jsonl", events)
    allocation = {"run_id": "ab" * 16, "stages": 2, "dp": 2, "pipelines": [[ID["p04"], ID["p01"]],
                                                                          [ID["p00"], ID["p03"]]],
                  "spares": [ID["p05"]], "layer_ranges": [[0, 1], [2, 3]], "predicted_iteration_s": 0.4}
    (tmp_path / "run.json").write_text(json.dumps({
        "run_id": "ab" * 16, "started_at": 1000.0, "issuer": "p00", "allocation": allocation,
        "request": {"preset": "small", "steps": 60, "seed": 7, "placement": "scheduler"}}))
    return state


def test_report_redraws_a_stopped_run_from_its_run_dir(tmp_path, capsys):
    _run_dir_of_a_finished_run(tmp_path)
    assert swarm_cli.main(["report", "--run-dir", str(tmp_path)]) == 0
    text = (tmp_path / "report.txt").read_text()
    assert capsys.readouterr().out.startswith(text)
    lines = text.splitlines()
    assert lines[0] == "run abababab, preset small, 60 steps, seed 7, placement scheduler"
    assert lines[1] == ("swarm: scenario worldwide, 6 peers: p00(eu), p01(us), p02(eu), p03(us), "
                        "p04(eu), p05(asia)")
    assert "  pipeline 0: p04(eu) -> p01(us)" in lines and "  spares: p05(asia)" in lines
    assert "iteration time: predicted 0.400 s, measured median 0.500 s (first step left out)" in lines
    assert "throughput: median 1030 tokens/s" in lines
    assert any(line.startswith("time: 60.0 s from train start (") and line.endswith("to step 60")
               for line in lines)
    assert "reconfigurations: 1; coordinators elected: 1" in lines
    assert "  +60.5s  reconfigure  term 2  epoch 2  peer 3fa2c1d0 is dead  2x4 -> 2x3" in text
    assert lines[-1] == f"loss plot: {tmp_path / 'loss.png'}"
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_and_plot_cope_with_steps_logged_without_a_loss(tmp_path, capsys):
    # A step whose last stages disagreed with no majority is logged with a null loss
    # (control/coordinator/steplog.py); the report says how many, the plot leaves them out.
    _run_dir_of_a_finished_run(tmp_path)
    rows = [step(k, 1, tokens_per_s=1000.0 + k, predicted_iteration_s=0.4) for k in range(60)]
    for k in (0, 7, 59):
        rows[k] |= {"loss": None, "loss_disagreement": {"3fa2c1d0": 0.0123, "9b1e77aa": 4.0}, "loss_no_majority": True}
    write_jsonl(tmp_path / "train.jsonl", rows)
    assert swarm_cli.main(["report", "--run-dir", str(tmp_path)]) == 0
    lines = (tmp_path / "report.txt").read_text().splitlines()
    assert f"loss: {rows[1]['loss']:.4f} at step 2 -> {rows[58]['loss']:.4f} at step 59" in lines
    assert "loss: none logged for 3 steps: the last stages disagreed with no majority (loss_no_majority)" in lines
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert merge_train([[rows[7]], [dict(rows[7], loss=3.9, term=0)]])[0]["loss"] == 3.9  # a loss wins


def test_report_without_reconfigurations_or_steps_says_so(tmp_path):
    _run_dir_of_a_finished_run(tmp_path, events=EVENTS[:1])  # the first election alone is no news
    assert format_reconfigurations(EVENTS[:1]) == []
    assert "reconfigurations: none" in runreport.write_report(tmp_path)
    (tmp_path / "train.jsonl").unlink()
    lines = runreport.write_report(tmp_path)
    assert "steps: none logged yet" in lines and lines[-1] == "loss plot: none (no step logged)"


def test_report_plot_marks_reconfigurations_and_names_the_preset(tmp_path, monkeypatch):
    _run_dir_of_a_finished_run(tmp_path)
    drawn = {}
    import matplotlib.figure

    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, out, **kw):
        loss_ax = fig.axes[0]
        drawn["title"] = loss_ax.get_title()
        drawn["vlines"] = [line.get_xdata()[0] for line in loss_ax.get_lines() if line.get_linestyle() == ":"]
        drawn["ylabels"] = [a.get_ylabel() for a in fig.axes]
        return real_savefig(fig, out, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    runreport.write_report(tmp_path)
    assert drawn["title"] == "preset small on the swarm: 6 peers, scenario worldwide, 2 stages x 2 pipelines"
    assert drawn["vlines"] == [41]  # the reconfiguration's resume step
    assert set(drawn["ylabels"]) == {"loss", "iteration time (s)", "tokens/s"}


def test_report_of_an_empty_dir_is_an_error(tmp_path, capsys):
    assert swarm_cli.main(["report", "--run-dir", str(tmp_path)]) == 1
    assert "no run in" in capsys.readouterr().err


# ---- dtfm-peer ----------------------------------------------------------------------------------

PEER_TRAINING = {
    "state": "training", "run_id": "12" * 16, "preset": "tiny", "stages": 2, "dp": 3, "epoch": 3, "stage": 1,
    "pipeline": 2, "step": 44, "role": "follower", "term": 4, "coordinator": "3fa2c1d0" + "0" * 56,
    "last_reconfig": {"at": 1000.0, "reason": "peer 77aa0011 is dead", "epoch": 3, "term": 4,
                      "old_shape": "2x4", "new_shape": "2x3", "predicted_old_s": 1.0, "predicted_new_s": 1.2,
                      "moves": 2, "bytes_moved": 3_400_000, "resume_step": 41},
}


def test_peer_status_shows_role_term_coordinator_and_last_reconfiguration():
    lines = format_training(PEER_TRAINING, now=1125.0)
    assert lines[0] == ("training  training, run 12121212, tiny, 2 stages x 3 pipelines, epoch 3, "
                        "stage 1 of pipeline 2, last step 45")
    assert lines[1] == "          role follower, term 4, coordinator 3fa2c1d0"
    assert lines[2] == ("          last reconfiguration: 2m 05s ago peer 77aa0011 is dead: 2x4 -> 2x3, "
                        "3.4 MB moved, resumed after step 41")


def test_peer_status_shows_the_compression_and_the_bytes_per_axis():
    t = {**PEER_TRAINING, "compression": "slow-link", "compression_details": "pipeline int4+hadamard/64; ...",
         "last_step": {"step": 44, "loss": 2.5, "iteration_s": 1.5,
                       "bytes_sent": {"pp_fwd": 139_456, "pp_bwd": 0, "dp": 81_150, "other": 8}}}
    lines = format_training(t, now=1125.0)
    assert lines[1] == "          compression slow-link: pipeline int4+hadamard/64; ..."
    assert ("          last step 45: loss 2.5000, 1.500 s, sent pp_fwd 139.5 kB, pp_bwd 0 B, dp 81.2 kB, "
            "other 8 B") in lines


def test_peer_status_of_an_older_or_idle_daemon():
    assert format_training({"state": "idle"}, now=0.0) == ["training  idle"]
    coord = format_training({"state": "training", "role": "coordinator", "term": 2, "coordinator": None,
                             "issued": {"run_id": "ab" * 16, "state": "training", "completed": 5,
                                        "end_step": 10}}, now=0.0)
    assert coord[1] == "          role coordinator, term 2, coordinator unknown (none heard from in this term)"
    assert coord[2] == "          issued run abababab: training, 6 of 10 steps done"  # steps 0..5


def test_peer_status_text_replaces_the_training_json_line():
    report = {"peer_id": "ab" * 32, "short_id": "abababab", "listen": "x", "uptime_s": 1.0,
              "peers": [], "departed": [], "gossip": {"n": 1}, "training": PEER_TRAINING}
    text = format_status_text(report, now=1125.0)
    assert text.startswith(format_text({k: v for k, v in report.items() if k != "training"}) + "\n")
    assert "last reconfiguration: 2m 05s ago" in text and '"last_reconfig"' not in text
    no_training = {k: v for k, v in report.items() if k != "training"}
    assert format_status_text(no_training) == format_text(no_training)


def test_format_reschedule():
    assert format_reschedule({"kind": "reconfigured", "old_shape": "2x4", "new_shape": "2x3", "moves": 2}) \
        == "reconfigured, 2x4 -> 2x3, 2 moves"
    # the coordinator's reconfiguration record, as control/reconfigure.py answers
    info = {"at": 1.0, "reason": "operator asked", "epoch": 3, "term": 2, "old_shape": "2x4", "new_shape": "4x2",
            "kind": "reshape", "predicted_old_s": 1.5, "predicted_new_s": 1.25, "moves": 4, "bytes_moved": 2_000_000,
            "resume_step": 12, "rollback": False, "stop_s": 0.4}
    assert format_reschedule(info) == ("reshape, 2x4 -> 4x2, 4 moves, 2.0 MB moved, predicted 1.500 s -> 1.250 s "
                                       "per step, epoch 3, resumed after step 12, operator asked")
    assert format_reschedule({"kind": "unchanged", "reason": "the current allocation is the best"}) \
        == "unchanged, the current allocation is the best"


async def test_train_reschedule_asks_the_daemon_signed_by_the_operator_key(capsys):
    asked = []
    reply = {"kind": "reconfigured", "old_shape": "2x4", "new_shape": "2x3", "moves": 2, "epoch": 4}
    run = b"r" * 16
    with tempfile.TemporaryDirectory(prefix="dtfm-cli-", dir="/tmp") as d:
        data_dir = DataDir(Path(d))
        data_dir.ensure()
        operator = OperatorKey.create(Path(d) / "swarm.key.operator")  # beside the daemon's swarm key
        info = {"operators": [operator.public_key.hex()], "run_id": run.hex(), "data_hash": "ab" * 32,
                "data_name": "corpus", "swarm_key_file": str(Path(d) / "swarm.key")}
        server = ControlServer(data_dir.control_socket, SocketConfig())

        async def reschedule(args):
            asked.append(args)
            return reply

        async def train_info(args):
            return info

        server.register("train_reschedule", reschedule)
        server.register("train_info", train_info)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            text_rc = await trio.to_thread.run_sync(peer_main, ["train", "reschedule", "--data-dir", d])
            text = capsys.readouterr().out
            json_rc = await trio.to_thread.run_sync(peer_main, ["train", "reschedule", "--json", "--data-dir", d])
            as_json = capsys.readouterr().out
            # another operator's key, one the swarm does not name, and none at all: clear errors
            other = OperatorKey.create(Path(d) / "other.operator")
            other_rc = await trio.to_thread.run_sync(peer_main, [
                "train", "reschedule", "--data-dir", d, "--operator-key", str(other.path)])
            other_err = capsys.readouterr().err
            (Path(d) / "swarm.key.operator").unlink()
            none_rc = await trio.to_thread.run_sync(peer_main, ["train", "reschedule", "--data-dir", d])
            none_err = capsys.readouterr().err
            nursery.cancel_scope.cancel()
    assert (text_rc, json_rc) == (0, 0)
    assert len(asked) == 2
    for a in asked:
        op = check_op(SignedOp.from_wire(a["op"]), "reschedule", {operator.public_key}, run_id=run)
        assert abs(op.issued_at_s - time.time()) < 60
    assert text == "reconfigured, 2x4 -> 2x3, 2 moves, epoch 4\n"
    assert json.loads(as_json) == reply
    assert other_rc == 1 and "is not one of this swarm's operators" in other_err
    assert none_rc == 1 and "no operator key at" in none_err and "--operator-key" in none_err


def test_train_reschedule_help(capsys):
    with pytest.raises(SystemExit) as info:
        peer_main(["train", "reschedule", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "coordinator" in out and "forwards" in out and "--json" in out


def test_a_back_filled_line_never_hides_the_line_its_coordinator_logged():
    real = {"step": 7, "epoch": 4, "term": 2, "loss": 3.94, "time": 10.0}
    backfill = {"step": 7, "epoch": 4, "term": 3, "loss": None, "backfilled": True, "time": 20.0}
    rerun = {"step": 7, "epoch": 5, "term": 3, "loss": 3.94, "time": 30.0}  # run again after a rollback
    assert merge_train([[backfill], [real]]) == [real]
    assert merge_train([[real, rerun], [backfill]]) == [rerun]
    partial = {"step": 8, "epoch": 4, "term": 2, "loss": None, "partial": True, "time": 11.0}
    full = {"step": 8, "epoch": 4, "term": 3, "loss": 3.9, "backfilled": True, "time": 21.0}
    assert merge_train([[partial], [full]]) == [full]  # the loss first: the partial line lost it
    own = {"step": 8, "epoch": 4, "term": 2, "loss": 3.9, "time": 11.0}
    assert merge_train([[own], [full]]) == [own]  # then its own coordinator's line


def test_status_says_when_the_run_is_stalled_and_why(tmp_path, fake_status):
    fake_status["p03"] = training(1, 1, "coordinator", 5, ID["p03"], state="stalled", issued={
        "run_id": "ab" * 16, "state": "stalled", "completed": 17, "end_step": 400, "stalled_s": 12.4,
        "reason": "step 18 is overdue (deadline 3.0 s): probing the peers that have not reported it",
        "cut_links": "8139770e-8a875fff"})
    text = format_status(status_report(make_state(tmp_path)))
    assert text.splitlines()[1] == (
        "run abababab: stalled, 18 of 400 steps done, no progress for 12 s: step 18 is overdue (deadline "
        "3.0 s): probing the peers that have not reported it (cut links: 8139770e-8a875fff)")


def test_train_start_line_says_1_stage_and_1_pipeline_in_the_singular():
    reply = {"steps": 6, "stages": 1, "dp": 1, "predicted_iteration_s": 0.25}
    assert swarm_cli.format_train_started("tiny", reply, "p0") == (
        "training tiny for 6 steps as 1 stage x 1 pipeline, issued by p0; predicted 0.250 s per step")
    reply = {**reply, "stages": 2, "dp": 3, "compression": "topk"}
    assert swarm_cli.format_train_started("tiny", reply, "p0") == (
        "training tiny for 6 steps as 2 stages x 3 pipelines, issued by p0; predicted 0.250 s per step; "
        "compression topk")


@pytest.mark.parametrize("command, kind, answer, printed", [
    (["train", "stop"], "stop", {"at_step": 3, "told": 2}, "the run stops after step 3 (2 peers told)"),
    (["train", "resume"], "resume", {"kind": "reconfigured", "resume_step": 3}, "run 72727272 resumes after step 3"),
])
async def test_stop_and_resume_send_an_operation_of_their_kind_signed_by_the_operator_key(
        capsys, command, kind, answer, printed):
    asked = []
    run = b"r" * 16
    with tempfile.TemporaryDirectory(prefix="dtfm-cli-", dir="/tmp") as d:
        data_dir = DataDir(Path(d))
        data_dir.ensure()
        operator = OperatorKey.create(Path(d) / "swarm.key.operator")
        info = {"operators": [operator.public_key.hex()], "run_id": run.hex(), "last_run_id": run.hex(),
                "swarm_key_file": str(Path(d) / "swarm.key")}
        server = ControlServer(data_dir.control_socket, SocketConfig())
        answers = [answer, ["not", "a", "map"]]

        async def handle(args):
            asked.append(args)
            return answers[len(asked) - 1]

        async def train_info(args):
            return info

        server.register("train_" + kind, handle)
        server.register("train_info", train_info)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            rc = await trio.to_thread.run_sync(peer_main, [*command, "--data-dir", d])
            said = capsys.readouterr()
            bad_rc = await trio.to_thread.run_sync(peer_main, [*command, "--data-dir", d])
            bad = capsys.readouterr().err
            nursery.cancel_scope.cancel()
    assert rc == 0 and printed in said.out + said.err
    check_op(SignedOp.from_wire(asked[0]["op"]), kind, {operator.public_key}, run_id=run)
    assert bad_rc == 1 and f"answer to `train {kind}` that is not a map" in bad


@pytest.mark.parametrize("terms, fails, attempts, started, code", [
    ([2, 3, 3], 1, 2, True, None),  # deposed midway: signed again and sent to the coordinator of now
    ([2, 2], 1, 1, False, None),  # refused in a steady term: the operator's error, not tried again
    ([2, 3, 3, 4, 4, 5], 3, 3, False, None),  # the elections never settle: three attempts, then the error
    # the first election's coordinator replaced before the run started: the daemon says so
    ([0, 1, 1], 1, 2, True, DEPOSED),
])
def test_a_start_interrupted_by_an_election_is_signed_and_sent_again(tmp_path, monkeypatch, terms, fails, attempts,
                                                                    started, code):
    state = make_state(tmp_path)
    peer = state.peers[0]
    term_answers, sent = iter(terms), []
    monkeypatch.setattr(train_mod, "peer_status", lambda p: {"training": {"term": next(term_answers)}})
    monkeypatch.setattr(train_mod, "operator_op", lambda run_dir, p, kind, args: SimpleNamespace(
        to_wire=lambda: {"op": len(sent)}))

    def request(p, op, args, timeout_s):
        sent.append(args["op"])
        if len(sent) <= fails:
            raise SwarmError("p00: the allocation was refused: c0464f9e: term 2 is older than this peer's term 3",
                             code=code)
        return {"run_id": "ab" * 16}
    monkeypatch.setattr(train_mod, "peer_request", request)
    if started:
        assert train_mod.start_training(state, peer, {"steps": 4}, tmp_path)["run_id"] == "ab" * 16
        assert json.loads((tmp_path / train_mod.RUN_NAME).read_text())["run_id"] == "ab" * 16
    else:
        with pytest.raises(SwarmError, match="refused"):
            train_mod.start_training(state, peer, {"steps": 4}, tmp_path)
    assert sent == [{"op": k} for k in range(attempts)]  # a new signed start each time


def test_a_daemons_refusal_keeps_its_kind_through_the_swarm_tools(tmp_path, monkeypatch):
    class Client:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def request(self, op, args):
            raise ControlClientError("replaced before the run started", code=DEPOSED)
    monkeypatch.setattr(proc_mod, "ControlClient", Client)
    with pytest.raises(SwarmError, match="p00: replaced") as e:
        proc_mod.peer_request(make_state(tmp_path).peers[0], "train_start", {})
    assert e.value.code == DEPOSED


def test_the_swarms_start_signs_the_micro_batch_count_auto_and_no_stages_auto(tmp_path, monkeypatch):
    state = make_state(tmp_path)
    signed = []
    monkeypatch.setattr(train_mod, "peer_status", lambda p: {"training": {"term": 1}})
    monkeypatch.setattr(train_mod, "operator_op", lambda run_dir, p, kind, args: signed.append(args) or SimpleNamespace(
        to_wire=lambda: {}))
    monkeypatch.setattr(train_mod, "peer_request", lambda p, op, args, timeout_s: {"run_id": "ab" * 16})
    train_mod.start_training(state, state.peers[0], {"steps": 4, "stages": "auto", "micro_batches": "auto",
                                                     "dp": None}, tmp_path)
    assert signed == [{"steps": 4, "micro_batches": "auto"}]


def test_clock_jump_moves_the_wall_clock_of_a_peer_or_a_region(tmp_path, monkeypatch, capsys):
    save_state(tmp_path, make_state(tmp_path))
    asked = []
    monkeypatch.setattr(swarm_cli, "peer_request", lambda p, op, args: asked.append((p.name, op, args)) or {})
    assert swarm_cli.main(["clock-jump", "p01", "-600", "--run-dir", str(tmp_path)]) == 0
    assert asked == [("p01", "emulate", {"clock_jump_s": -600.0})]
    assert "wall clock of p01 moved by -600 s" in capsys.readouterr().err
    asked.clear()
    assert swarm_cli.main(["clock-jump", "eu", "0", "--run-dir", str(tmp_path)]) == 0
    assert [a[0] for a in asked] == ["p00", "p02", "p04"] and "restored" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        swarm_cli.main(["clock-jump", "p01", "1e12", "--run-dir", str(tmp_path)])
    assert "within a year" in capsys.readouterr().err


def test_a_council_without_its_quorum_is_named_with_what_ends_the_wait(tmp_path, fake_status):
    """Two of five voters dead: a quorum of four cannot be had, no coordinator is elected, and
    the run only goes on when they come back or the operator names a new council."""
    election = {"role": "pre-candidate", "term": 5, "coordinator": None, "voters": 5, "quorum": 4,
                "live_voters": 3, "gone_voters": [ID["p04"], ID["p05"]]}
    for name in ("p00", "p01", "p02"):
        fake_status[name] = {**fake_status[name], "election": election}
    rep = status_report(make_state(tmp_path))
    assert rep["council_lost"] == {"live_voters": 3, "quorum": 4, "voters": 5, "gone": ["p04", "p05"]}
    text = format_status(rep)
    assert "council lost its quorum: 3 of 5 voters alive, 4 needed (gone: p04, p05)" in text
    assert "dtfm-peer train council" in text
    for name in ("p00", "p01", "p02"):  # a council with its quorum: nothing said
        fake_status[name] = {**fake_status[name], "election": {**election, "live_voters": 4, "gone_voters": [ID["p05"]]}}
    rep = status_report(make_state(tmp_path))
    assert "council_lost" not in rep and "quorum" not in format_status(rep)
