"""A colocated synchronous job in ``bench loop`` (issue 44 item 3): the pool's and the
trainer's GPUs all roll out, then all train, its engines on the memory the trainer's
state leaves them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backends.sim.profiles import GPU_MEMORY_GIB, at_memory_utilization, load_profile
from bench.runners.loop import Colocated, run_cell
from bench.simulator.loop import run_loop
from bench.simulator.loop_run import LoopScenario
from bench.simulator.speeds import band_profiles


def test_an_engine_on_less_memory_gives_up_kv_cache_on_every_gpu() -> None:
    p = load_profile("qwen3-14b", "H100", 2)
    half = at_memory_utilization(p, 0.5)
    lost = 2 * 0.4 * GPU_MEMORY_GIB["h100"] * 2**30 / p.kv_bytes_per_token
    assert p.kv_capacity_tokens - half.kv_capacity_tokens == pytest.approx(lost, abs=1)
    assert half.W_ms == p.W_ms and half.K_ms_per_tok == p.K_ms_per_tok  # only the KV
    assert at_memory_utilization(p, 0.9) is p
    # Qwen3-32B's 64 GB of weights leave one H100 at 0.5 no KV cache at all
    with pytest.raises(ValueError, match="does not fit"):
        at_memory_utilization(load_profile("qwen3-32b", "H100", 1), 0.5)
    assert 1 not in band_profiles("qwen3-32b", "H100", "calibrated", 8, 0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        at_memory_utilization(p, 1.5)


def test_less_kv_cache_preempts_and_slows_a_loaded_pool() -> None:
    """16 GPUs of TP1 at 16 trajectories each: at verl's 0.5 the engines preempt."""
    sc = LoopScenario("math-code", "verl-tp1", gpus=16, prompts=16, steps=3)
    full, half = run_loop(sc), run_loop(replace(sc, memory=0.5))
    assert sum(half.rollout_s) > 1.05 * sum(full.rollout_s)
    with pytest.raises(ValueError, match="memory"):
        run_loop(replace(sc, memory=0.0))


def test_colocated_sync_is_the_same_job_rolling_out_and_training_on_all_gpus() -> None:
    base = LoopScenario("math-code", "verl-tp4", gpus=8, prompts=4, steps=3, push_s=5.0)
    colo = [Colocated(8, 0.5, 10.0), Colocated(8, 0.5, 30.0), Colocated(8, 0.5, 10.0, 2)]
    cell = run_cell(base, layouts=("verl-tp4", "verl-tp8"), modes=(), policies=(),
                    seeds=(1, 2), screen_seeds=1, train_ratios=(0.25,), jobs=1,
                    colocated=colo)
    part = cell["ratios"]["0.25"]
    t, rows = part["train_s"], part["rows"]
    swept = cell["colocated_rollout_s"]["+8 GPUs, memory 0.5"]
    assert set(swept) == {"verl-tp4", "verl-tp8"}
    best = min(swept, key=swept.__getitem__)
    fast, slow = rows[f"{colo[0].name}@{best}"], rows[f"{colo[1].name}@{best}"]
    # seed 1 again, by hand: 16 GPUs at 0.5 roll out; the trainer's step on all 16 GPUs
    # takes 8/16 of its time on its own 8; then the switch, not the disaggregated push
    run = run_loop(replace(base, policy=best, gpus=16, memory=0.5, train_s=0.0))
    seconds = sum(r + t * 8 / 16 + 10.0 for r in run.rollout_s[1:])
    assert fast["tokens_per_seed"]["1"] == pytest.approx(
        3600 * sum(run.trained_tokens[1:]) / seconds)
    assert slow["tokens_per_hour"] < fast["tokens_per_hour"]  # the same rollouts, 20 s more
    assert fast["max_staleness"] == 0 and fast["length_bias"] == pytest.approx(1.0)
    # twice the groups per step: its own sweep, its trainer twice as long
    swept2 = cell["colocated_rollout_s"]["x2 +8 GPUs, memory 0.5"]
    best2 = min(swept2, key=swept2.__getitem__)
    run2 = run_loop(replace(base, policy=best2, gpus=16, memory=0.5, prompts=8, train_s=0.0))
    assert run2.samples[0] == 2 * run.samples[0]
    seconds2 = sum(r + 2 * t * 8 / 16 + 10.0 for r in run2.rollout_s[1:])
    assert rows[f"{colo[2].name}@{best2}"]["per_seed"]["1"] == pytest.approx(
        3600 * sum(run2.samples[1:]) / seconds2)
    # the disaggregated sync on 8 GPUs is what the ratio is taken against
    assert rows[f"sync@{cell['best_static']}"]["tokens_vs_best_sync"]["geomean"] == 1.0


def test_the_page_merges_colocated_rows_only_where_the_memory_share_changed_nothing() -> None:
    from bench.reports.loop_table import _collapse_memory

    def row(tokens: float) -> dict[str, float]:
        return {"tokens_per_hour": tokens, "samples_per_hour": 100.0, "idle_share": 0.3}

    rows = {"sync@verl-tp8": row(1.0),
            "colocated sync +8 GPUs, memory 0.5, switch 10 s@verl-tp8": row(2.0),
            "colocated sync +8 GPUs, memory 0.8, switch 10 s@verl-tp8": row(2.001),
            "colocated sync x4 +8 GPUs, memory 0.5, switch 10 s@verl-tp8": row(3.0),
            "colocated sync x4 +8 GPUs, memory 0.8, switch 10 s@verl-tp8": row(3.3)}
    out, merged = _collapse_memory(rows)
    assert merged == ["0.5", "0.8"]
    assert list(out) == ["sync@verl-tp8",
                         "colocated sync +8 GPUs, memory 0.5-0.8, switch 10 s@verl-tp8",
                         "colocated sync x4 +8 GPUs, memory 0.5, switch 10 s@verl-tp8",
                         "colocated sync x4 +8 GPUs, memory 0.8, switch 10 s@verl-tp8"]
    assert out["colocated sync +8 GPUs, memory 0.5-0.8, switch 10 s@verl-tp8"] == row(2.0)
