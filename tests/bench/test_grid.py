"""``bench grid``: every cell pits policies against the best uniform static layout; an
infeasible layout is recorded, not a crash; the summary and the heat map come from the runs."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

from bench.runners.grid import Cell, summarize, verdicts
from rollout_gateway.cli import app


def test_bench_grid_runs_each_cell_and_reports_against_the_best_static(tmp_path) -> None:
    out = tmp_path / "grid.json"
    args = ["bench", "grid", "--json", str(out), "--gpus", "2", "--per-gpu", "4",
            "--workload", "math-code", "--tp-efficiency", "low", "--tp-efficiency",
            "calibrated", "--policy", "verl-tp1", "--policy", "verl-tp2", "--policy",
            "replay", "--seeds", "2", "--steps", "2", "--jobs", "1"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 2 * 3 * 2 and doc["command"].startswith("rollout-gateway bench grid")
    assert out.with_suffix(".png").stat().st_size > 1000
    for band in ("low", "calibrated"):
        row = doc["summary"][f"qwen3-14b/H100/2gpu/4pg/math-code/{band}"]
        means = row["mean_s"]
        assert row["best_static"] == min(("verl-tp1", "verl-tp2"), key=means.__getitem__)
        g, lo, hi = row["replay_vs_best_static"]
        assert lo <= g <= hi and g == pytest.approx(means[row["best_static"]] / means["replay"],
                                                    rel=0.05)
        assert row["headroom"] >= 1.0  # the critical path bounds every schedule
    assert doc["beliefs"] == "live"
    # a resumed grid runs nothing again, and refuses to mix beliefs
    r = CliRunner().invoke(app, [*args, "--resume"])
    assert r.exit_code == 0 and json.loads(out.read_text())["runs"] == doc["runs"]
    r = CliRunner().invoke(app, [*args, "--resume", "--beliefs", "true"])
    assert r.exit_code == 2 and "run with beliefs 'live'" in r.output


def test_an_infeasible_layout_is_left_out_of_the_comparison() -> None:
    cell = Cell("qwen3-32b", "H100", 16, 4, "search", "low")
    runs = {f"{cell.key}|verl-tp1|{s}": {"infeasible": "request needs 22934 tokens of KV"}
            for s in (1, 2)}
    for p, base in (("verl-tp2", 100.0), ("heddle", 130.0), ("replay", 95.0)):
        runs.update({f"{cell.key}|{p}|{s}": {"makespans": [999.0, base * s]} for s in (1, 2)})
    doc = {"cells": [asdict(cell)], "policies": [
        "verl-tp1", "verl-tp2", "heddle", "replay"], "seeds": [1, 2], "runs": runs}
    row = summarize(doc)[cell.key]
    assert row["best_static"] == "verl-tp2" and row["infeasible"] == ["verl-tp1"]
    assert row["replay_vs_best_static"][0] == pytest.approx(100 / 95)
    assert row["replay_vs_heddle"][0] == pytest.approx(130 / 95)  # step 1 (cold) left out
    # step 1 (where replay probes) has its own ratio, and counts in the whole run's
    assert row["replay_step1_vs_best_static"][0] == pytest.approx(1.0)
    assert row["replay_all_steps_vs_best_static"][0] == pytest.approx(
        ((999 + 100) * (999 + 200) / ((999 + 95) * (999 + 190))) ** 0.5)
    v = verdicts(summarize(doc))
    assert v["cells"] == 1 and v["at_least_0.98x_best_static"] == 1
    assert v["interval_not_below_0.95"] == 1
    assert v["best_static_not_tp8"] == 1 and v["of_those_at_least_1.15x"] == 0
