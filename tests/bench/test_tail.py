"""`bench tail`: the k longest trajectories of a step, alone, against `bench steps` runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bench.simulator.metrics import critical_path
from bench.simulator.speeds import profiles
from bench.simulator.steps import StepScenario, generate_step
from bench.simulator.tail import TailJob, longest, tail_makespan
from rollout_gateway.cli import app

SMALL = ["--workload", "math-code", "--gpus", "8", "--per-gpu", "4", "--steps", "2",
         "--seeds", "2", "--jobs", "1"]


def test_longest_keeps_the_k_longest_critical_paths_at_the_given_tp():
    specs = generate_step("search", 3, 1, prompts=6)
    prof = profiles("qwen3-14b", "H100", None, 8)[8]
    top = longest(specs, 5)
    cut = min(critical_path(s, prof) for s in top)
    rest = [s for s in specs if s not in top]
    assert len(top) == 5 and len(rest) == len(specs) - 5
    assert all(critical_path(s, prof) <= cut for s in rest)
    assert longest(specs, len(specs) + 10) == longest(specs, len(specs))


def test_tail_of_the_whole_step_is_the_step_and_the_verdict_is_paired(tmp_path):
    steps_json, tail_json = tmp_path / "steps.json", tmp_path / "tail.json"
    r = CliRunner().invoke(app, ["bench", "steps", *SMALL, "--policy", "verl-tp8",
                                 "--policy", "verl-tp2", "--json", str(steps_json)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["bench", "tail", *SMALL, "--top", "32", "--top", "4",
                                 "--against", str(steps_json), "--json", str(tail_json)])
    assert r.exit_code == 0, r.output
    steps = json.loads(steps_json.read_text())["results"]
    doc = json.loads(tail_json.read_text())
    assert doc["trajectories_per_step"] == 32 and doc["ks"] == [4, 32]
    # k = the whole step under the best static layout is that layout's own run (the run's
    # round-robin counter and clock carry across steps, hence not to the last digit)
    for seed, v in steps["verl-tp8"]["per_seed_s"].items():
        assert doc["per_k"]["32:verl-tp8"][seed] == pytest.approx(v, rel=0.02)
        # one reported step: the estimate is the slower k under its faster layout
        assert doc["estimate_s"]["per_seed_s"][seed] == pytest.approx(max(
            min(doc["per_k"][f"{k}:{p}"][seed] for p in ("verl-tp8", "verl-tp4"))
            for k in (4, 32)))
    assert doc["against"]["verl-tp2"]["geomean"] > doc["against"]["verl-tp8"]["geomean"]
    need = doc["target"]["needs_x_estimate"]
    assert need == pytest.approx(doc["against"]["verl-tp8"]["geomean"] / 1.15)
    assert "out of reach" in r.output


@pytest.mark.parametrize(("extra", "message"), [
    (["--top", "0"], "between 1 and"),
    (["--top", "33"], "between 1 and"),
    (["--layout", "nope"], "not a layout"),
    (["--steps", "1"], "at least 2"),
    (["--against", "README.md"], "not a `bench steps --json` file"),
])
def test_bad_options_are_refused_before_any_simulation(extra, message):
    args = ["bench", "tail", *SMALL, *extra]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2
    assert message in " ".join(r.output.split())


@pytest.mark.parametrize("layout", ["verl-tp8", "straggler-lane-oracle"])
def test_a_step_cannot_beat_its_longest_trajectory_alone(layout):
    """k = 1 is the longest trajectory alone on a TP8 instance: the critical-path bound
    (plus the per-call overhead); more of the step's trajectories can only add to it. A
    perfect-predictor policy may be tried, the subset's truth handed to it."""
    base = StepScenario("math-code", layout, steps=2, gpus=8, prompts=4)
    specs = generate_step("math-code", 1, 1, prompts=4)
    crit = critical_path(longest(specs, 1)[0], profiles("qwen3-14b", "H100", None, 8)[8])
    one = tail_makespan(TailJob(base, 1, 1))
    assert crit <= one <= crit * 1.02
    assert tail_makespan(TailJob(base, 1, 8)) >= one
