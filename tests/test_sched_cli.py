"""dtfm-sched on the command line: JSON shape, cost re-computed from the printed pipelines."""

import json

import pytest
from test_sched_cost import paper_cost_literal

from dtfm.scenarios import load_scenario
from dtfm.sched import PAPER_GPT3_XL
from dtfm.sched.cli import main


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


def test_errors_are_one_line_without_traceback(capsys):
    rc, _, err = run(capsys, "solve", "--scenario", "atlantis")
    assert rc == 2 and "no scenario 'atlantis'" in err
    rc, _, err = run(capsys, "solve", "--scenario", "worldwide", "--stages", "16", "--dp", "8")
    assert rc == 2 and "needs 128 peers" in err


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "alloc.png"
    rc, _, _ = run(capsys, "solve", "--scenario", "universities", "--peers", "8", "--stages", "4",
                   "--time-budget", "30", "--generations", "1", "--plot", str(png))
    assert rc == 0 and png.stat().st_size > 0
