"""dtfm-sched on the command line: JSON shape, cost re-computed from the printed pipelines."""

import json

import numpy as np
import pytest
from test_sched_cost import paper_cost_literal

from dtfm.scenarios import load_scenario
from dtfm.sched import PAPER_GPT3_XL, cost_model, get_preset, simulate_iteration, solve
from dtfm.sched.cli import main, plot_title


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_solve_json_cost_is_that_of_the_printed_pipelines(capsys):
    rc, out, _ = run(capsys, "solve", "--scenario", "worldwide", "--model", "gpt3-xl-paper", "--stages", "8",
                     "--dp", "8", "--seed", "1", "--time-budget", "30", "--generations", "1", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["scenario"] == "worldwide" and doc["stages"] == 8 and doc["dp"] == 8
    assert len(doc["pipelines"]) == 8 and all(len(p) == 8 for p in doc["pipelines"])
    assert sorted(i for p in doc["pipelines"] for i in p) + doc["spares"] == list(range(64))
    sc = load_scenario("worldwide")
    wl = PAPER_GPT3_XL.workload(8, 8)
    dp, pp, total = paper_cost_literal(sc.delay_ms(), sc.bandwidth_gbps(), doc["pipelines"], wl.grad_gb(3), wl.act_gb)
    assert doc["cost"]["total_s"] == pytest.approx(total, rel=1e-12)
    assert doc["cost"]["dp_s"] == pytest.approx(dp, rel=1e-12)
    assert doc["cost"]["pp_s"] == pytest.approx(pp, rel=1e-12)
    assert doc["elapsed_s"] > 0


def test_compare_puts_the_search_at_or_below_every_baseline(capsys):
    rc, out, _ = run(capsys, "compare", "--scenario", "universities", "--time-budget", "30", "--generations", "1",
                     "--random-samples", "200", "--json")
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(out)["rows"]}
    assert set(rows) == {"search", "random (best of 200)", "region per DP group", "region per pipeline",
                         "homogeneous (consecutive)"}
    for r in rows.values():
        assert rows["search"]["cost_s"] <= r["cost_s"] + 1e-9
        assert r["simulated_s"] > 0


def test_text_output_and_scaled_scenario(capsys):
    rc, out, _ = run(capsys, "solve", "--scenario", "regional", "--peers", "12", "--stages", "4",
                     "--time-budget", "30", "--generations", "1")
    assert rc == 0
    assert "4 stages x 3 pipelines" in out and "pipeline 0:" in out


def test_solve_costs_the_micro_batch_counts_and_keeps_the_fastest(capsys):
    """--micro-batches auto: the allocation simulated at every count that divides the
    per-pipeline batch, the fastest kept; N: that count alone, the same figure."""
    argv = ("solve", "--scenario", "worldwide", "--peers", "8", "--model", "gpt-tiny", "--stages", "4", "--dp", "1",
            "--time-budget", "30", "--generations", "1", "--json")
    rc, out, _ = run(capsys, *argv, "--micro-batches", "auto")
    assert rc == 0
    doc = json.loads(out)
    times = {r["micro_batches"]: r["simulated_iteration_s"] for r in doc["micro_batches_tried"]}
    assert sorted(times) == [1, 2, 4, 8, 16, 32, 64]  # gpt-tiny: a global batch of 64
    assert doc["micro_batches"] == min(times, key=times.get) and doc["simulated_iteration_s"] == min(times.values())
    assert times[1] > times[doc["micro_batches"]] < times[64]  # the bubble at one end, the window at the other
    rc, out, _ = run(capsys, *argv, "--micro-batches", "4")
    fixed = json.loads(out)
    assert fixed["micro_batches"] == 4 and fixed["simulated_iteration_s"] == pytest.approx(times[4])
    rc, out, err = run(capsys, "solve", "--scenario", "worldwide", "--micro-batches", "auto")
    assert rc == 1 and "model gpt3-xl-paper has no batch" in err


@pytest.mark.parametrize("argv,message", [
    (["--scenario", "atlantis"], "no scenario 'atlantis'"),
    (["--scenario", "worldwide", "--stages", "16", "--dp", "8"], "needs 128 peers, worldwide has 64"),
    (["--scenario", "worldwide", "--stages", "25"], "--stages 25: model gpt3-xl-paper has only 24 layers"),
    (["--scenario", "regional", "--peers", "4", "--stages", "8"], "--stages 8 needs at least 8 peers"),
    (["--scenario", "regional", "--peers", "10", "--stages", "4", "--no-spares"], "do not form 4 x 2"),
    (["--scenario", "regional", "--peers", "3", "--stages", "auto", "--dp", "5"], "no shape of the 3 peers"),
])
def test_user_errors_exit_1_with_one_line(capsys, argv, message):
    rc, out, err = run(capsys, "solve", *argv)
    assert rc == 1 and out == ""
    assert err.startswith("dtfm-sched: error: ") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ["--scenario", "worldwide", "--stages", "many"],
    ["--scenario", "worldwide", "--dp", "0"],
    ["--scenario", "worldwide", "--time-budget", "-1"],
    ["--scenario", "worldwide", "--model", "nosuch"],
    ["--stages", "4"],
])
def test_bad_command_lines_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(["solve", *argv])
    assert info.value.code == 2
    assert "dtfm-sched solve: error:" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "alloc.png"
    rc, _, _ = run(capsys, "solve", "--scenario", "universities", "--peers", "8", "--stages", "4",
                   "--time-budget", "30", "--generations", "1", "--plot", str(png))
    assert rc == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_names_its_cost_and_orders_the_heat_map_by_pipeline(tmp_path, monkeypatch):
    import matplotlib.figure

    drawn = {}

    def savefig(fig, path, **kw):
        left, heat = fig.axes[0], fig.axes[1]
        drawn["title"] = left.get_title()
        drawn["labels"] = (heat.get_xlabel(), heat.get_ylabel())
        drawn["ticks"] = [t.get_text() for t in heat.get_yticklabels()]
        drawn["matrix"] = heat.get_images()[0].get_array()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    X = np.array([[0, 2], [1, 3]])  # stage x pipeline: pipeline 0 is peers 0 -> 1, pipeline 1 is 2 -> 3
    delay = np.array([[0, 1, 50, 50], [1, 0, 50, 50], [50, 50, 0, 2], [50, 50, 2, 0]], dtype=float)
    from dtfm.sched.plot import plot_allocation

    plot_allocation(tmp_path / "a.png", delay, ["eu", "eu", "us", "us"], X, [], "t")
    # pipeline by pipeline: the in-pipeline blocks lie on the diagonal
    assert drawn["matrix"].tolist() == [[0, 1, 50, 50], [1, 0, 50, 50], [50, 50, 0, 2], [50, 50, 2, 0]]
    assert drawn["ticks"] == ["pipeline 0", "pipeline 1"]
    assert drawn["labels"] == ("to peer: pipeline by pipeline, stages 0..1 in each", "from peer")
    sc = load_scenario("universities").scaled(8)
    alloc = solve(sc.delay_ms(), sc.bandwidth_gbps(), get_preset("gpt-tiny"), stages=4, time_budget_s=1,
                  generations=1)
    title = plot_title("universities", alloc)
    assert title.startswith("universities: 4 stages x 2 pipelines\ncommunication cost per iteration (DT-FM's): ")
    assert f"= data-parallel {alloc.cost.dp_s:.2f} s + 2 x pipeline {alloc.cost.pp_s:.2f} s" in title


def test_solve_prints_the_pipeline_schedule_that_beats_gpipe_on_the_printed_pipelines(capsys):
    """`solve` fits the stages' order of forwards and backwards to the result (1F1B warm-ups,
    `fitted_warmups`): the JSON's `scheduled_iteration_s` is the simulator's under
    `pipeline_warmups`, below GPipe's `simulated_iteration_s`, and the text says so."""
    argv = ("solve", "--scenario", "worldwide", "--peers", "8", "--model", "gpt-tiny", "--stages", "4", "--dp", "2",
            "--seed", "0", "--time-budget", "0.3", "--generations", "1")
    rc, out, _ = run(capsys, *argv, "--json")
    doc = json.loads(out)
    w = doc["pipeline_warmups"]
    assert rc == 0 and w is not None and len(w) == 4 and w == sorted(w, reverse=True) and w[-1] == 0
    assert doc["scheduled_iteration_s"] < doc["simulated_iteration_s"]
    sc = load_scenario("worldwide").scaled(8)
    model = cost_model(sc.delay_ms(), sc.bandwidth_gbps(), get_preset("gpt-tiny"), 4, 2)
    X = np.array(doc["pipelines"]).T
    assert simulate_iteration(model, X, warmups=w).iteration_s == pytest.approx(doc["scheduled_iteration_s"])
    rc, out, _ = run(capsys, *argv)
    assert f"pipeline schedule: 1F1B with warm-ups {','.join(map(str, w))}" in out
