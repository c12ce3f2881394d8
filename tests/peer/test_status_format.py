"""`dtfm-peer status` for people: gossip's links as a table with their state explained
(gossip/status.py, peer/status.py), and the training section without contradictions after a
restart (control/status.py PlaneStatus over the epoch machine's snapshot). The coordinator's
side (stopped, finished, paused runs) is in tests/control/coordinator/test_coordinator_machine.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from machine_trace import RUN, FakeElection, N, alloc, report

from dtfm.control.coordinator.machine import CoordinatorStatus, Phase
from dtfm.control.epoch.machine import EpochMachine, RunClosed
from dtfm.control.status import PlaneStatus
from dtfm.gossip import Entry, Report
from dtfm.gossip import view as gossip_view
from dtfm.gossip.status import gossip_status, link_state
from dtfm.peer import status as peer_status
from dtfm.peer.status import format_gossip, format_issued, format_status_text, format_training, reconfiguration_parts

A, B, C, D = ("a1" * 32, "b2" * 32, "c3" * 32, "d4" * 32)


def member(peer: str, region: str, state: str = "alive") -> dict:
    return {"id": peer, "short_id": peer[:8], "region": region, "address": "127.0.0.1:1", "state": state}


GOSSIP = {
    "counts": {"alive": 4, "suspect": 0, "unconfirmed": 0, "dead": 0, "left": 1, "total": 5},
    "members": [member(A, "eu-west"), member(B, "us-east"), member(C, "asia"), member(D, "us-west"),
                member("e5" * 32, "eu-west", "left")],
    "latency": [
        {"target": B[:8], "rtt_ms": 0.13782211593865187, "bandwidth_gbps": 1.93, "samples": 5, "peer_rtt_ms": 0.31,
         "peer_bandwidth_gbps": 2.0, "measured_s_ago": 12.3, "link": "disputed", "disputed_on": ["rtt"]},
        {"target": C[:8], "rtt_ms": 42.0, "bandwidth_gbps": 0.35, "samples": 5, "peer_rtt_ms": None,
         "peer_bandwidth_gbps": None, "measured_s_ago": 3.0, "link": "one-sided", "disputed_on": []}],
    "view": {"peers": [A, B, C, D], "measured_links": 8, "expected_links": 12, "complete": False,
             "disputed": [[A, B]], "one_sided_links": 1, "peer_count": 4},
    "truncated": [],
}


# ---- links -------------------------------------------------------------------------------------


def test_links_are_a_table_with_the_disputed_link_explained():
    lines = format_gossip(GOSSIP, A)
    assert lines[0] == "members   5 known: 4 alive, 1 left (dtfm-peer members lists them)"
    assert lines[1] == ("links     2 measured by this peer, 1 not yet; swarm-wide 4 of 6 peer pairs measured, "
                        "1 disputed")
    assert lines[2].split() == ["PEER", "REGION", "RTT", "BANDWIDTH", "MEASURED", "LINK"]
    assert lines[3] == "  b2b2b2b2  us-east  0.14 ms  1.9 Gbps   12s ago   disputed: rtt 0.14 ms here, 0.31 ms there"
    assert lines[4] == "  c3c3c3c3  asia     42 ms    350 Mbps   3.0s ago  one-sided"
    assert lines[5] == "  d4d4d4d4  us-west  -        -          never     not measured yet"
    legend = " ".join(line.strip() for line in lines[6:])
    assert legend.startswith("(disputed: the two ends of the link measured it more than 1.5x apart")
    assert "the scheduler takes the worse of the two figures" in legend
    assert "On one machine or a LAN this is measurement noise" in legend
    assert "(one-sided: the other end has not reported its measurement of the link yet" in legend
    assert all(len(line) <= 100 for line in lines[6:])


def test_the_legend_is_shown_only_for_the_words_in_the_table():
    agreed = dict(GOSSIP["latency"][0], link="agreed", disputed_on=[])
    gossip = {**GOSSIP, "latency": [agreed], "view": {**GOSSIP["view"], "disputed": []}}
    text = "\n".join(format_gossip(gossip, A))
    assert "agreed" in text and "disputed" not in text and "one-sided" not in text
    both = dict(agreed, link="disputed", disputed_on=["rtt", "bandwidth"], peer_bandwidth_gbps=0.5)
    row = format_gossip({**gossip, "latency": [both]}, A)[3]
    assert row.endswith("disputed: rtt 0.14 ms here, 0.31 ms there; bandwidth 1.9 Gbps here, 500 Mbps there")


def test_status_text_has_no_gossip_json_line_and_keeps_other_sections():
    report = {"peer_id": A, "short_id": A[:8], "listen": "127.0.0.1:7000", "uptime_s": 3.0, "peers": [],
              "departed": [], "gossip": GOSSIP, "swarm_key_fingerprint": "1234abcd",
              "training": {"state": "idle", "role": "follower", "term": 0, "coordinator": None}}
    text = format_status_text(report, now=0.0)
    assert '"latency"' not in text and "0.13782211593865187" not in text and B not in text
    assert "swarm_key_fingerprint 1234abcd" in text
    assert text.splitlines()[-2:] == ["training  idle",
                                      "          role follower, term 0, coordinator none known to this peer (it "
                                      "holds no council: a swarm has no coordinator before its first `train "
                                      "start`, and a peer that joined later learns it with the first allocation "
                                      "it is handed)"]
    # a gossip section the daemon had to cut to fit its reply stays visible as what it is
    cut = format_status_text({**report, "gossip": {"truncated": True, "bytes": 9}}, now=0.0)
    assert 'gossip    {"bytes": 9, "truncated": true}' in cut


@pytest.mark.parametrize("election, coordinator, who", [
    # Operator review L1: a fresh joiner of a swarm that had a coordinator said "none yet (one is
    # elected at the swarm's first train start)"
    ({"voters": 0, "heard_of": None}, None, "none known to this peer (it holds no council"),
    ({"voters": 0, "heard_of": B}, None, f"{B[:8]} (as its peers say; this peer holds no council to check it "
                                         "against until it is handed its first allocation)"),
    ({"voters": 3, "heard_of": B}, None, f"{B[:8]} (as its peers say; outside its council, this peer does not "
                                         "follow it)"),
    ({"voters": 3, "heard_of": None}, None, "none yet (one is elected at the swarm's first `train start`)"),
    ({"voters": 3, "heard_of": B}, A, A[:8]),
])
def test_the_coordinator_line_says_what_this_peer_knows_of_the_swarms_coordinator(election, coordinator, who):
    training = {"state": "idle", "role": "follower", "term": 0, "coordinator": coordinator, "election": election}
    line = format_status_text({"peer_id": A, "short_id": A[:8], "training": training}, now=0.0).splitlines()[-1]
    assert line.startswith(f"          role follower, term 0, coordinator {who}"), line


def test_the_ratio_in_the_legend_is_gossips():
    assert peer_status.DISAGREEMENT_RATIO == gossip_view.DISAGREEMENT_RATIO


def test_link_states_from_both_ends():
    peer = bytes.fromhex(B)
    mine = Entry(peer, 10.0, 1.0, 5)
    assert link_state(mine, None) == ("one-sided", [])
    assert link_state(mine, Entry(peer, 14.0, 0.7, 5)) == ("agreed", [])
    assert link_state(mine, Entry(peer, 16.0, 1.0, 5)) == ("disputed", ["rtt"])
    assert link_state(mine, Entry(peer, 10.0, 0.5, 5)) == ("disputed", ["bandwidth"])
    assert link_state(mine, Entry(peer, 4.0, 0.0, 5)) == ("disputed", ["rtt"])  # no bandwidth there yet


def test_gossip_status_rows_carry_the_other_ends_figures_and_age():
    me, b, c = (bytes.fromhex(x) for x in (A, B, C))
    reports = {b: Report(b, 1, 0.0, 1.0, (Entry(me, 0.4, 2.0, 5),)),
               c: Report(c, 1, 0.0, 1.0, (Entry(b, 0.1, 2.0, 5),)),  # c has not measured me
               me: Report(me, 1, 0.0, 1.0, (Entry(b, 0.1, 2.0, 5),))}
    entries = [Entry(b, 0.1, 2.0, 5), Entry(c, 0.2, 0.0, 3)]
    st = gossip_status([], lambda p: True, entries, [me, b, c], reports,
                       lambda: gossip_view.build_view((me, b, c), reports), me=me, measured_s_ago={b: 4.0})
    rows = {r["target"]: r for r in st["latency"]}
    assert rows[B[:8]] == {"target": B[:8], "rtt_ms": 0.1, "bandwidth_gbps": 2.0, "samples": 5,
                          "peer_rtt_ms": 0.4, "peer_bandwidth_gbps": 2.0, "measured_s_ago": 4.0,
                          "link": "disputed", "disputed_on": ["rtt"]}
    assert (rows[C[:8]]["link"], rows[C[:8]]["peer_rtt_ms"], rows[C[:8]]["measured_s_ago"]) == ("one-sided", None,
                                                                                                  None)
    assert st["view"]["disputed"] == [sorted([A, B])]  # the view flags the same link


# ---- training: finished, stopped, grammar --------------------------------------------------------


def test_a_finished_run_counts_its_steps():
    assert format_issued({"run_id": "ab" * 16, "state": "finished", "completed": 299, "end_step": 300}) \
        == "issued run abababab: finished, all 300 steps done"
    assert format_issued({"run_id": "ab" * 16, "state": "stopped", "completed": 121, "end_step": 200,
                          "reason": "an operator stopped the run after step 122 (train stop)"}) \
        == ("issued run abababab: stopped, 122 of 200 steps done (an operator stopped the run after step 122 "
            "(train stop))")
    assert format_issued({"run_id": "ab" * 16, "state": "refused", "completed": -1, "end_step": 1}) \
        == "issued run abababab: refused, 0 of 1 step done"
    assert format_issued({"run_id": "ab" * 16, "state": "stalled", "completed": 17, "end_step": 400,
                          "stalled_s": 72.4, "reason": "step 18 is overdue"}) \
        == "issued run abababab: stalled, 18 of 400 steps done, no progress for 1m 12s (step 18 is overdue)"



def test_the_peers_left_out_for_refusing_are_shown_with_why():
    left = [{"peer": "8f" * 32, "code": "busy", "reason": "an insider refuses", "since": 100.0, "until": 130.0,
             "refusals": 1}]
    assert format_issued({"run_id": "ab" * 16, "state": "training", "completed": 9, "end_step": 100,
                          "left_out": left}) \
        == "issued run abababab: training, 10 of 100 steps done; left out: 8f8f8f8f (busy: an insider refuses, for 30s)"


def test_joined_peers_the_run_is_not_faster_with_are_shown_outside_it():
    issued = {"run_id": "ab" * 16, "state": "training", "completed": 9, "end_step": 100}
    assert format_issued({**issued, "kept_out": ["8f" * 32]}) \
        == "issued run abababab: training, 10 of 100 steps done; outside the run: 8f8f8f8f (the run is not faster with it)"
    assert format_issued({**issued, "kept_out": ["8f" * 32, "9a" * 32]}).endswith(
        "outside the run: 8f8f8f8f, 9a9a9a9a (the run is not faster with them)")
    assert format_issued({**issued, "kept_out": "junk"}) == format_issued(issued)


def test_one_stage_and_one_pipeline_are_singular():
    line = format_training({"state": "training", "run_id": "ab" * 16, "preset": "tiny", "stages": 1, "dp": 2},
                           now=0.0)[0]
    assert line == "training  training, run abababab, tiny, 1 stage x 2 pipelines"


def test_an_aborted_epoch_of_a_run_that_went_on_is_not_the_end_of_the_run():
    t = {"state": "training", "epoch": 4,
         "last_end": {"epoch": 3, "completed": 57, "reason": "peer 1a2b3c4d failed: connection lost",
                      "failed": True}}
    assert format_training(t, now=0.0)[-1] == ("          epoch 3 was cut short after step 58: peer 1a2b3c4d failed: "
                                               "connection lost (the run went on in epoch 4)")
    assert "run ended" not in "\n".join(format_training(t, now=0.0))
    reconf = {"state": "stopped", "epoch": 3, "last_end": {"epoch": 3, "completed": 57, "reason": "stopped",
                                                           "failed": False}}
    assert format_training(reconf, now=0.0)[-1] == ("          epoch 3 ended after step 58: stopped at a step "
                                                    "boundary for a reconfiguration of the run")


# ---- a restarted daemon ---------------------------------------------------------------------------


IDLE = CoordinatorStatus(Phase.IDLE, None, None, "", None, None, (), None, None)


def restarted(kept=(), stopped=False) -> dict:
    """A peer's training status right after a restart: applied.json held term 2 epoch 3 of RUN,
    its checkpoints kept `kept` step reports, stopped.json said an operator stopped it."""
    election = FakeElection(N[1], term=2, coordinator=None, voters=tuple(N[:4]))
    m = EpochMachine(N[1], election, heartbeat_wait_s=1.0, coordinator_lost_after_s=6.0)
    m.restore(RUN, 2, 3, alloc(term=2, epoch=3, end_step=300), kept)
    if stopped:
        m.handle(RunClosed(RUN, "stopped"), 0.0)
    return PlaneStatus(N[1], {"role": "follower", "term": 2, "coordinator": None}, False, m.status(), IDLE,
                       Path("train.jsonl"), None, 1).to_wire()


def test_a_restarted_peer_says_its_run_is_from_before_the_restart():
    st = restarted([report(3, 120)])
    assert (st["state"], st["restored"], st["epoch"]) == ("waiting", True, 3)
    lines = format_training(st, now=0.0)
    assert lines[1] == ("          (restored after this daemon restarted: the last allocation it applied, from its "
                        "data dir; a new one replaces it)")
    assert lines[2].startswith("          (waiting: this daemon restarted and holds no stage")


def test_a_peer_restarted_after_an_operators_stop_says_stopped():
    st = restarted([report(3, 120)], stopped=True)
    assert (st["state"], st["run_stopped"]) == ("stopped", True)


def test_a_peer_restarted_after_the_run_finished_says_finished():
    st = restarted([report(3, 298), report(3, 299)])
    assert st["state"] == "finished" and st["last_end"]["completed"] == 299
    assert format_training(st, now=0.0)[-1] == "          epoch 3 ended after step 300: the run finished"


def test_a_peer_restarted_after_the_run_finished_without_it_says_so():
    # (the review's case: the coordinator, killed at step 20, restarted after its successor
    # finished the run; its own checkpoints stop at step 19)
    election = FakeElection(N[1], term=2, coordinator=N[0], voters=tuple(N[:4]))
    m = EpochMachine(N[1], election, heartbeat_wait_s=1.0, coordinator_lost_after_s=6.0)
    m.restore(RUN, 1, 1, alloc(end_step=80), [report(1, 19)])
    assert m.restored_run_to_ask(0.0) == RUN
    m.restored_run_heard(RUN, "finished", 80)
    st = PlaneStatus(N[1], {"role": "follower", "term": 2, "coordinator": N[0].hex()}, False, m.status(), IDLE,
                     Path("train.jsonl"), None, 1).to_wire()
    assert (st["state"], st["run_ended"]) == ("finished", {"state": "finished", "steps_done": 80})
    assert ("          (the run finished while this daemon was down, its coordinator says: 80 of 80 steps done)"
            in format_training(st, now=0.0))


# ---- step numbers ----------------------------------------------------------------------------------

def test_every_text_numbers_a_step_as_train_status_follow_does():
    # The walkthrough's run: step index 25 was the last one of epoch 1 (`step 26/100` in
    # `train status --follow`); a peer died, the run went on at index 26 (`step 27/100`); an
    # operator stopped it after index 132 (`step 133/100`). Every other text must name the same
    # steps, not the daemons' 0-based indices.
    from dtfm.control.coordinator.machine import stopped_after
    from dtfm.peer.cli import format_reschedule
    from dtfm.peer.follow import format_reconfig, format_step

    assert format_step({"step": 25, "epoch": 1}, 100, None).startswith("step 26/100 ")
    reconf = {"epoch": 2, "kind": "shrink", "old_shape": "1x3", "new_shape": "1x2", "resume_step": 26,
              "at": 1.0, "reason": "peer b846add1 failed"}
    assert format_reconfig(reconf) == ("reconfigured (epoch 2, shrink): 1x3 -> 1x2, resumed after step 26: "
                                       "peer b846add1 failed")
    assert format_reschedule(reconf).endswith("epoch 2, resumed after step 26, peer b846add1 failed")
    assert format_reconfig({**reconf, "rollback": True, "resume_step": 20}).endswith(
        "rolled back, resumed after step 20: peer b846add1 failed")
    assert "resumed from its first step" in format_reconfig({**reconf, "resume_step": 0})
    assert f"an operator stopped the run {stopped_after(133)}" == "an operator stopped the run after step 133"
    assert stopped_after(0) == "before its first step"
    stopped = {"state": "stopped", "run_id": "ab" * 16, "preset": "tiny", "stages": 1, "dp": 2, "epoch": 5,
               "step": 132, "last_reconfig": {**reconf, "at": 0.0},
               "last_step": {"step": 132, "loss": 2.6709, "iteration_s": 0.3},
               "last_end": {"epoch": 5, "completed": 132, "reason": "stopped", "failed": False}}
    lines = format_training(stopped, now=10.0)
    assert lines[0].endswith(", epoch 5, last step 133")
    assert any(line.endswith("resumed after step 26") for line in lines)
    assert "          last step 133: loss 2.6709, 0.300 s" in lines
    assert lines[-1] == ("          epoch 5 ended after step 133: stopped at a step boundary for a "
                         "reconfiguration of the run")


def test_start_and_export_count_one_stage_in_the_singular():
    from dtfm.peer.cli import format_exported, format_started

    reply = {"steps": 100, "stages": 1, "dp": 3, "predicted_iteration_s": 0.0614}
    assert format_started("tiny", reply).startswith("training tiny for 100 steps as 1 stage x 3 pipelines; "
                                                    "predicted 0.061 s per step (")
    assert format_started("tiny", {**reply, "stages": 2, "dp": 1}).startswith("training tiny for 100 steps as "
                                                                             "2 stages x 1 pipeline;")
    assert format_exported("8d" * 16, {"step": 600, "model": "tiny", "stages": [{}], "bytes_fetched": 10_442_024,
                                       "out": "/tmp/m"}) \
        == "exported run 8d8d8d8d at step 600 (tiny, 1 stage, 10.4 MB fetched) to /tmp/m"


@pytest.mark.parametrize("record, missing, want", [
    ({}, "? bytes", {}),
    ({"old_shape": "2x4", "new_shape": "2x3", "moves": 2, "bytes_moved": 12_500_000, "resume_step": 41},
     "? bytes", {"shape": "2x4 -> 2x3", "moves": "2 moves", "moved": "12.5 MB moved", "resumed": "resumed after step 41"}),
    ({"new_shape": "2x2", "moves": 0, "bytes_moved": 0, "resume_step": 0},
     "? bytes", {"shape": "- -> 2x2", "moves": "0 moves", "moved": "0 B moved", "resumed": "resumed from its first step"}),
    ({"old_shape": "2x2", "resume_step": 20, "rollback": True}, "? bytes",
     {"shape": "2x2 -> -", "resumed": "rolled back, resumed after step 20"}),
    ({"bytes_moved": "lots"}, "-", {"moved": "- moved"}),
    ({"bytes_moved": "lots"}, "? bytes", {"moved": "? bytes moved"}),
])
def test_reconfiguration_parts_says_only_what_the_record_gives(record, missing, want):
    assert reconfiguration_parts(record, bytes_missing=missing) == want


def test_refused_membership_updates_are_one_line_under_the_members():
    gossip = {**GOSSIP, "refused": {"address group at its cap of members": 134, "member table full": 2,
                                    "bad signature": 0}, "evicted": 7}
    lines = format_gossip(gossip, A)
    assert lines[1] == ("refused   136 membership updates: 134 address group at its cap of members, "
                        "2 member table full")
    assert lines[2].startswith("links ")
    assert format_gossip(GOSSIP, A)[1].startswith("links ")  # nothing refused: no line


# ---- memory ------------------------------------------------------------------------------------


def test_memory_is_shown_against_the_stage_state():
    """The process's resident memory and peak on one line, with the peak against the stage's own
    state; the stage's parts under training. An idle daemon shows its memory alone."""
    stage = {"stage_bytes": 1_250_000_000, "weights_bytes": 170_000_000, "grads_bytes": 170_000_000,
             "optimizer_bytes": 340_000_000, "snapshot_bytes": 510_000_000, "activations_bytes": 60_000_000}
    text = format_status_text({"peer_id": A, "short_id": A[:8], "memory": {"rss_bytes": 1_500_000_000,
                                                                           "peak_rss_bytes": 1_750_000_000},
                               "training": {"state": "training", "memory": stage}})
    assert "memory    resident 1.5 GB, peak 1.8 GB (1.40x the stage's state)" in text
    loaded = format_status_text({"peer_id": A, "memory": {"rss_bytes": 1_500_000_000, "peak_rss_bytes": 1_750_000_000},
                                 "training": {"state": "training", "memory": stage, "data_bytes": 32_126_760}})
    assert "(1.40x the stage's state); data set 32.1 MB" in loaded
    assert ("stage state 1.2 GB: weights 170.0 MB, gradients 170.0 MB, optimizer 340.0 MB, snapshot 510.0 MB, "
            "activations 60.0 MB") in text
    assert '"rss_bytes"' not in text  # in words, not as a JSON line
    idle = format_status_text({"peer_id": A, "memory": {"rss_bytes": 80_000_000, "peak_rss_bytes": 90_000_000},
                               "training": {"state": "idle"}})
    assert "memory    resident 80.0 MB, peak 90.0 MB\n" in idle + "\n" and "stage state" not in idle


def test_plane_status_carries_the_stage_memory():
    from dtfm.train import StageMemory

    election = FakeElection(N[1], term=2, coordinator=None, voters=tuple(N[:4]))
    m = EpochMachine(N[1], election, heartbeat_wait_s=1.0, coordinator_lost_after_s=6.0)
    m.restore(RUN, 2, 3, alloc(term=2, epoch=3, end_step=300), ())
    status = PlaneStatus(N[1], {"role": "follower", "term": 2, "coordinator": None}, False, m.status(), IDLE,
                         Path("train.jsonl"), None, 1, stage_memory=StageMemory(4, 4, 8, 12, 3))
    assert status.to_wire()["memory"] == {"stage_bytes": 31, "weights_bytes": 4, "grads_bytes": 4,
                                          "optimizer_bytes": 8, "snapshot_bytes": 12, "activations_bytes": 3}
    assert "memory" not in dataclasses.replace(status, stage_memory=None).to_wire()


def test_the_compute_figure_is_a_line_when_known():
    line = "compute   33.1 ms per reference block (forward and backward; measured at start, then from this " \
           "peer's own training steps)"
    assert format_gossip({**GOSSIP, "compute_ms": 33.1}, A)[-1] == line
    assert not any(x.startswith("compute") for x in format_gossip({**GOSSIP, "compute_ms": None}, A))
    shared = format_gossip({**GOSSIP, "compute_ms": 70.0, "compute_share": 0.5}, A)[-1]
    assert shared.endswith("training steps, at 0.50 of a core (this machine's other work took the rest))")
    assert format_gossip({**GOSSIP, "compute_ms": 33.1, "compute_share": 0.99}, A)[-1] == line  # (a whole core)


def test_the_training_section_says_when_the_council_lost_its_quorum():
    election = {"role": "pre-candidate", "term": 3, "coordinator": None, "voters": 5, "quorum": 4,
                "live_voters": 3, "gone_voters": [A, B]}
    lines = format_training({"state": "stalled", "role": "pre-candidate", "term": 3, "coordinator": None,
                             "election": election}, now=0.0)
    text = "\n".join(lines)
    assert f"council lost its quorum: 3 of its 5 voters alive, 4 needed to elect a coordinator (gone: {A[:8]}, {B[:8]})" in text
    assert "`dtfm-peer train council`" in text
    election.update(live_voters=4, gone_voters=[A])
    assert not any("quorum" in x for x in format_training({"term": 3, "election": election}, now=0.0))
