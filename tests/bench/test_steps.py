"""`bench steps`: per-seed results are kept, and policies are compared seed by seed."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from bench.simulator.steps import interval, paired_ratio
from rollout_gateway.cli import app


def test_paired_ratio_of_a_constant_speedup_has_no_spread():
    base = {"1": 100.0, "2": 400.0, "3": 50.0}  # seeds differ 8x in makespan
    other = {s: v / 1.25 for s, v in base.items()}
    g, lo, hi = paired_ratio(base, other)
    assert g == pytest.approx(1.25) and lo == pytest.approx(1.25) and hi == pytest.approx(1.25)
    # the unpaired intervals of the two policies overlap almost entirely
    (mb, hb), (mo, ho) = interval(list(base.values())), interval(list(other.values()))
    assert mb - hb < mo + ho


def test_paired_ratio_uses_only_common_seeds_and_brackets_the_geomean():
    base = {"1": 100.0, "2": 200.0, "3": 300.0, "9": 1.0}
    other = {"1": 90.0, "2": 170.0, "3": 280.0}
    g, lo, hi = paired_ratio(base, other)
    expect = math.exp(sum(math.log(base[s] / other[s]) for s in other) / 3)
    assert g == pytest.approx(expect)
    assert lo < g < hi
    with pytest.raises(ValueError):
        paired_ratio({"1": 1.0}, {"2": 1.0})


def test_bench_steps_reports_per_seed_makespans_and_the_paired_ratio(tmp_path):
    out = tmp_path / "steps.json"
    args = ["bench", "steps", "--workload", "math-code", "--gpus", "2", "--per-gpu", "4",
            "--steps", "2", "--seeds", "2", "--jobs", "1", "--policy", "slime-tp1",
            "--policy", "slime-tp2", "--json", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    best = doc["best_static"]
    res = doc["results"]
    assert best in ("slime-tp1", "slime-tp2")
    for name, row in res.items():
        assert set(row["per_seed_s"]) == {"1", "2"}
        assert row["mean_s"] == pytest.approx(sum(row["per_seed_s"].values()) / 2)
        g = row["vs_best_static"]["geomean"]
        assert row["vs_best_static"]["ci95_low"] <= g <= row["vs_best_static"]["ci95_high"]
        assert (g == pytest.approx(1.0)) == (name == best)
    assert "paired 95% CI" in r.output
