"""Weight updates in the discrete-event simulator: cost in makespan, staleness, versions."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backends.sim.kv_cache import KVCache
from bench.cli import bench_app
from bench.simulator.metrics import Result
from bench.simulator.run import Bench, Scenario
from bench.simulator.weights import MODES

SC = Scenario("math-code", gpus=8, prompts=4, group_size=4, seed=3)
EVERY = 30.0


@pytest.fixture(scope="module")
def runs() -> dict[str, Result]:
    out = {"off": Bench(SC).run("slime")}
    for mode in MODES:
        sc = replace(SC, weight_update_every_s=EVERY, weight_update_mode=mode)
        out[mode] = Bench(sc).run("slime")
    return out


def _same(a: Result, b: Result) -> bool:
    return {**a.as_dict(), "wall_s": 0} == {**b.as_dict(), "wall_s": 0}


def test_off_and_never_due_change_nothing(runs: dict[str, Result]) -> None:
    again = Bench(SC).run("slime")
    assert _same(runs["off"], again) and runs["off"].weights is None
    # an update schedule that never comes due runs the same batch to the same numbers
    far = Bench(replace(SC, weight_update_every_s=1e9)).run("slime")
    assert far.weights is not None and far.weights["updates"] == 0
    assert {**far.as_dict(), "wall_s": 0, "weights": None} == {**again.as_dict(), "wall_s": 0}


def test_every_mode_costs_makespan_and_counts_updates(runs: dict[str, Result]) -> None:
    off = runs["off"].makespan_s
    for mode in MODES:
        r = runs[mode]
        assert r.weights is not None
        assert r.makespan_s > off, mode
        w = r.weights
        assert w["updates"] >= 1 and w["paused_s"] >= w["updates"] * 5.0  # update_s each
    # keep and abort freeze at once (one step at most), so no update is ever late:
    # one per EVERY seconds that started before the batch ended
    for mode in ("keep", "abort-and-continue"):
        ws = runs[mode].weights
        assert ws is not None
        assert ws["updates"] == math.ceil(runs[mode].makespan_s / EVERY) - 1
        assert ws["drain_s"] < 0.2 * ws["updates"]


def test_staleness_by_mode(runs: dict[str, Result]) -> None:
    wait = runs["wait"].weights
    assert wait is not None
    assert wait["spanning_calls"] == 0  # wait drains: no call runs across an update
    assert wait["drain_s"] > 0 and wait["resubmitted"] == 0
    for mode in ("keep", "abort-and-continue"):
        w = runs[mode].weights
        assert w is not None
        assert w["spanning_calls"] >= 1 and w["max_staleness"] >= 1
        assert 0 < w["stale_token_frac"] < 1
        assert w["resubmitted"] >= w["spanning_calls"]
    for r in runs.values():
        if r.weights is not None:
            assert r.weights["max_staleness"] <= r.weights["updates"]


def test_every_token_is_tagged_once() -> None:
    """Continuations neither lose nor repeat tokens: per-version counts add up exactly."""
    from bench.simulator.des import SimConfig, Simulator
    from gateway.policies.registry import get_policy

    bench = Bench(SC)
    for mode in MODES:
        cfg = SimConfig(SC.gpus, bench.profiles, bench.speeds, seed=SC.seed,
                        weight_update_every_s=20.0, weight_update_mode=mode)
        sim = Simulator(bench.specs, get_policy("slime", seed=SC.seed), cfg)
        sim.run()
        assert sim.weights is not None
        for s in bench.specs:
            assert sum(sim.weights.tokens[s.id].values()) == s.total_output, (mode, s.id)
        for inst in sim.instances.values():
            inst.engine.kv.check_invariants(inst.engine.owned_plain_blocks())


def test_prefix_cache_reset_refuses_while_blocks_are_owned() -> None:
    kv = KVCache(8, 4)
    assert kv.allocate(1)
    kv.register(11)
    assert not kv.reset_prefix_cache()
    kv.release([11], 0)
    assert kv.num_cached_blocks == 1 and kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0 and kv.num_free == 8
    kv.check_invariants(0)


def test_cli_reports_weight_updates(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = CliRunner().invoke(bench_app, [
        "sim", "--workload", "math-code", "--gpus", "8", "--prompts", "2", "--group-size", "2",
        "--policy", "slime", "--weight-update-every", "20", "--weight-update-mode", "keep",
        "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "stale" in res.output
    doc = json.loads(out.read_text())
    assert doc["results"]["slime"]["weights"]["updates"] >= 1
    bad = CliRunner().invoke(bench_app, ["sim", "--weight-update-every", "20",
                                         "--weight-update-mode", "nope"])
    assert bad.exit_code != 0 and "weight update mode" in bad.output


def test_steps_carry_the_schedule() -> None:
    from bench.simulator.steps import StepScenario, run_steps, summarize

    sc = StepScenario("math-code", "slime", steps=2, gpus=8, prompts=2, group_size=2,
                      weight_update_every_s=20.0, weight_update_mode="abort-and-continue")
    run = run_steps(sc)
    assert len(run.weights) == 2 and all(w["updates"] >= 1 for w in run.weights)
    row = summarize({"slime": [run]})["slime"]
    assert row["w_updates"] == run.weights[1]["updates"]
    off = run_steps(replace(sc, weight_update_every_s=None))
    assert off.weights == [] and all(
        a < b for a, b in zip(off.makespans, run.makespans, strict=True))


def test_recompute_all_frees_kv_and_requests_finish_exactly() -> None:
    from backends.sim.engine import EngineCore
    from backends.sim.profiles import load_profile
    from backends.sim.request import SimRequest

    eng = EngineCore(load_profile("qwen3-14b", "H100", 1))
    for i in range(2):
        eng.add_request(SimRequest(f"r{i}", list(range(1, 100)), 50, ignore_eos=True))
    for _ in range(10):
        eng.step()
    before = {r.id: n for r, n in eng.live_requests()}
    assert before == {"r0": 10, "r1": 10}
    assert eng.recompute_all() == 2 and eng.num_running == 0 and eng.num_waiting == 2
    assert eng.kv.reset_prefix_cache() and eng.kv.num_free == eng.kv.num_blocks
    emitted: dict[str, int] = {}
    while eng.has_work:
        for rid, k in eng.step().emitted.items():
            emitted[rid] = emitted.get(rid, 0) + k
    assert emitted == {"r0": 40, "r1": 40}  # the rest, nothing repeated or lost
