"""dtfm-swarm's pure parts: run-dir state, peer lookup, the measured view in scenario units."""

import pytest

from dtfm.swarm import cli as swarm
from dtfm.swarm.proc import gossip_profile, plane_flags
from dtfm.swarm.report import DEMO_PRESET, demo_model, measured_matrices
from dtfm.swarm.state import PeerEntry, SwarmError, SwarmState, load_state, save_state
from dtfm.train import get_preset


def make_state(tmp_path):
    state = SwarmState(scenario="worldwide", scenario_name="worldwide", time_scale=2.0,
                       bandwidth_scale=0.1)
    for k, region in enumerate(["Oregon", "Tokyo", "Tokyo"]):
        state.peers.append(PeerEntry(name=f"p{k:02d}", index=k, region=region, port=9000 + k,
                                     data_dir=str(tmp_path / f"p{k:02d}"),
                                     peer_id=f"{k:02d}" * 32))
    return state


def test_state_round_trips_through_the_run_dir(tmp_path):
    state = make_state(tmp_path)
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    assert not list(tmp_path.glob(".swarm.*.tmp"))


def test_missing_run_dir_says_how_to_start(tmp_path):
    with pytest.raises(SwarmError, match="dtfm-swarm up"):
        load_state(tmp_path / "nothing")


def test_find_by_name_index_and_id_prefix(tmp_path):
    state = make_state(tmp_path)
    assert state.find("p01").index == 1
    assert state.find("2").name == "p02"
    assert state.find("0101").name == "p01"
    with pytest.raises(SwarmError, match="no peer"):
        state.find("p09")


def test_measured_view_is_reordered_and_unscaled(tmp_path):
    state = make_state(tmp_path)
    ids = [p.peer_id for p in state.peers]
    # The observer lists peers in another order: p02, p00, p01.
    view_order = [ids[2], ids[0], ids[1]]
    raw_delay = {(a, b): 10.0 * (1 + a + b) for a in range(3) for b in range(3) if a != b}
    matrix = [[0.0 if a == b else raw_delay[(a, b)] for b in range(3)] for a in range(3)]
    report = {"gossip": {"view": {"peers": view_order, "delay_ms": matrix,
                                  "bandwidth_gbps": [[None, 0.05, 0.05], [0.05, None, 0.02],
                                                     [0.05, 0.02, None]],
                                  "complete": True}}}
    m = measured_matrices(report, ids, time_scale=2.0, bandwidth_scale=0.1)
    # p00 is row 1 of the observer's view, p01 row 2: raw 10 * (1 + 1 + 2) = 40 ms, / time scale.
    assert m["raw_delay_ms"][0][1] == 40.0
    assert m["delay_ms"][0][1] == 20.0
    # Bandwidth back in scenario units: raw x time_scale / bandwidth_scale.
    assert m["bandwidth_gbps"][0][1] == pytest.approx(0.02 * 2.0 / 0.1)
    assert m["complete"] is True
    missing = measured_matrices(report, ids + ["ff" * 32], 1.0, 1.0)
    assert missing["delay_ms"][3][0] is None


def test_cli_errors_are_one_line_without_traceback(tmp_path, capsys):
    assert swarm.main(["status", "--run-dir", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dtfm-swarm: error: no swarm in {tmp_path / 'none'}") and err.count("\n") == 1


@pytest.mark.parametrize("flags,message", [
    (["--scenario", "atlantis"], "no scenario 'atlantis'"),
    (["--peers", "1"], "--peers must be between 2 and 256"),
    (["--time-scale", "0"], "--time-scale / --bandwidth-scale: time_scale must be a positive number"),
    (["--bandwidth-scale", "nan"], "bandwidth_scale must be a positive number"),
])
def test_up_refuses_bad_settings_before_starting_peers(tmp_path, capsys, flags, message):
    run_dir = tmp_path / "run"
    assert swarm.main(["up", "--run-dir", str(run_dir), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dtfm-swarm: error: ") and message in err and err.count("\n") == 1
    assert not run_dir.exists()


def test_bad_command_line_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        swarm.main(["up", "--peers", "many"])
    assert info.value.code == 2
    assert "dtfm-swarm up: error: argument --peers" in capsys.readouterr().err


def test_demo_model_is_trains_preset():
    gpt = get_preset(DEMO_PRESET)
    spec = demo_model(6)
    assert (spec.name, spec.layers, spec.hidden, spec.heads, spec.seq_len, spec.vocab) == (
        gpt.name, gpt.n_layer, gpt.n_embd, gpt.n_head, gpt.seq_len, gpt.vocab)
    assert spec.global_batch_seqs == 48


@pytest.mark.parametrize("scenario,emulated,profile,flags", [
    # worldwide round trips (up to 476 ms) outgrow the lan election's 0.4 s lease
    ("worldwide", True, "test", ["--plane-profile", "test", "--election-profile", "wan"]),
    ("worldwide", False, "test", ["--plane-profile", "test"]),
    ("datacenter", True, "test", ["--plane-profile", "test"]),
    ("universities", True, "lan", ["--plane-profile", "lan"]),
    ("worldwide", True, "wan", ["--plane-profile", "wan"]),
])
def test_peers_run_the_plane_profile_with_an_election_that_fits_the_links(scenario, emulated, profile, flags):
    state = SwarmState(scenario=scenario, scenario_name=scenario, time_scale=1.0, bandwidth_scale=0.05,
                       emulated=emulated, plane_profile=profile)
    assert plane_flags(state) == flags
    assert gossip_profile(state) == ("wan" if scenario == "worldwide" and emulated else "lan")


def test_up_runs_the_test_plane_profile_unless_told():
    assert swarm.build_parser().parse_args(["up"]).plane_profile == "test"
    assert swarm.build_parser().parse_args(["up", "--plane-profile", "wan"]).plane_profile == "wan"
