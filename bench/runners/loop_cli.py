"""``rollout-gateway bench loop``: step modes past the synchronous barrier, in trained
tokens and samples per hour, against the best static synchronous layout (bench/simulator/loop.py,
bench/runners/loop.py, docs/step-modes.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.options import Gpu, Model, Progress, band_point


def _fmt(row: dict[str, Any]) -> str:
    v, t = row["vs_best_sync"], row["tokens_vs_best_sync"]
    lags = "/".join(f"{row[k]:.0%}" for k in ("lag0_share", "lag1_share", "lag2_share",
                                               "lag3plus_share"))
    return (f"{row['tokens_per_hour'] / 1e6:6.2f}M tok/h  {t['geomean']:.2f}x "
            f"({t['ci95_low']:.2f}-{t['ci95_high']:.2f})  {row['samples_per_hour']:6.0f} "
            f"samples/h {v['geomean']:.2f}x  staleness 0/1/2/3+ {lags} "
            f"(max {row['max_staleness']:.0f})  wasted {row['wasted_share']:.0%}  "
            f"idle {row['idle_share']:.0%}  length bias {row['length_bias']:.2f}  "
            f"sandboxes {row['sandboxes_mean']:.0f} (peak {row['sandboxes_peak']:.0f})")


def loop(
    workload: Annotated[list[str] | None, typer.Option(
        help="repeatable; default swe, search, math-code")] = None,
    tp_efficiency: Annotated[list[str] | None, typer.Option(
        "--tp-efficiency", help="repeatable band points; default low and calibrated")] = None,
    mode: Annotated[list[str] | None, typer.Option(
        help="repeatable: overprovisioned, overprovisioned-drop, async, tail-batching "
             "(default all); sync always runs")] = None,
    policy: Annotated[list[str] | None, typer.Option(
        help="repeatable: also run every mode under this policy (e.g. replay)")] = None,
    gpus: Annotated[int, typer.Option()] = 64,
    model: Model = "qwen3-14b",
    gpu: Gpu = "H100",
    per_gpu: Annotated[int, typer.Option(help="trajectories per GPU per trainer step")] = 8,
    sync_batch: Annotated[list[int] | None, typer.Option(
        help="repeatable: also sync on the best layout with this many times the batch "
             "(its trainer as many times longer; default 2 and 4: 16 and 32 per GPU at "
             "--per-gpu 8); 1 or less: none")] = None,
    colocated_trainer_gpus: Annotated[list[int] | None, typer.Option(
        help="repeatable: also a colocated sync job (verl's default) on the pool's GPUs "
             "plus this many trainer GPUs, rollout and training in turn on all of them, at "
             "the batch and at each --sync-batch multiple (default: none)")] = None,
    colocated_memory: Annotated[list[float] | None, typer.Option(
        help="repeatable: the colocated engines' gpu_memory_utilization (default 0.5, "
             "verl's, and 0.8, slime's advice with the trainer offloaded)")] = None,
    colocated_switch: Annotated[list[float] | None, typer.Option(
        help="repeatable: seconds per colocated step to sleep the engines, move the "
             "trainer's state and the weights (default 10 and 30)")] = None,
    steps_: Annotated[int, typer.Option("--steps", help="trainer steps (1 is not reported)")]
    = 8,
    seeds: Annotated[int, typer.Option(help="seeds 1..N")] = 5,
    screen_seeds: Annotated[int, typer.Option(
        help="seeds every static layout runs before the best one runs the rest")] = 2,
    train_ratio: Annotated[list[float] | None, typer.Option(
        help="repeatable: the trainer's time per step over the best static layout's "
             "rollout per step (default 0.25)")] = None,
    push_s: Annotated[float, typer.Option(help="weight push, engines paused (s)")] = 10.0,
    over: Annotated[float, typer.Option(
        help="extra groups started by overprovisioned and tail-batching (0.25: 25%)")] = 0.25,
    max_staleness: Annotated[int, typer.Option(help="bound on trained tokens' version lag")]
    = 1,
    on_stale: Annotated[str, typer.Option(help="restart | drop")] = "restart",
    jobs: Annotated[int, typer.Option(help="processes")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="results (after each cell)")]
    = None,
) -> None:
    """Samples per hour of each step mode vs the best static synchronous layout."""
    from bench.runners.loop import MODE_RUNS, STATIC, Colocated, cell_count, run_cell
    from bench.simulator.loop_run import LoopScenario
    from bench.workloads import load_workloads
    from gateway.policies.registry import ALL_NAMES, resolve_names

    table = load_workloads()
    wls = workload or ["swe", "search", "math-code"]
    bad = [w for w in wls if w not in table]
    modes = mode or list(MODE_RUNS)
    bad_modes = [m for m in modes if m not in MODE_RUNS]
    pols = resolve_names(policy or [])
    bad_pols = [p for p in pols if p not in ALL_NAMES]
    if bad or bad_modes or bad_pols:
        raise typer.BadParameter(f"unknown: {bad + bad_modes + bad_pols}; workloads "
                                 f"{', '.join(table)}, modes {', '.join(MODE_RUNS)}")
    if steps_ < 2 or not 1 <= screen_seeds <= seeds:
        raise typer.BadParameter("need --steps >= 2 and 1 <= --screen-seeds <= --seeds")
    bands = tp_efficiency or ["low", "calibrated"]
    points = [band_point(b, model, gpu) for b in bands]
    ratios = train_ratio or [0.25]
    batches = [k for k in (sync_batch if sync_batch is not None else [2, 4]) if k > 1]
    mems = colocated_memory or [0.5, 0.8]
    colo = [Colocated(k, m, sw, times) for times in [1, *batches]
            for k in colocated_trainer_gpus or [] for m in mems
            for sw in colocated_switch or [10.0, 30.0]]
    if any(c.trainer_gpus < 1 or not 0 < c.memory <= 1 or c.switch_s < 0 for c in colo):
        raise typer.BadParameter("need --colocated-trainer-gpus >= 1, 0 < "
                                 "--colocated-memory <= 1 and --colocated-switch >= 0")
    per_cell = cell_count(len(STATIC), len(modes), len(pols), seeds, screen_seeds, len(ratios),
                          len(batches), len({c.job for c in colo}))
    doc: dict[str, Any] = {"command": " ".join(["rollout-gateway", "bench", "loop",
                                                *sys.argv[3:]]), "cells": {},
                           # policies believe what the engines measured (LoopScenario),
                           # and replay relays out at weight pushes (its at_pause)
                           "beliefs": "live"}
    with Progress(transient=False) as prog:
        task = prog.add_task(f"{len(wls) * len(bands)} cells, {per_cell} runs each",
                             total=per_cell * len(wls) * len(bands))
        for w in wls:
            size = table[w]["group_size"]
            for band, point in zip(bands, points, strict=True):
                base = LoopScenario(w, STATIC[0], steps=steps_, gpus=gpus, model=model,
                                    gpu=gpu, tp_efficiency=point,
                                    prompts=max(1, per_gpu * gpus // size), push_s=push_s,
                                    over=over, max_staleness=max_staleness,
                                    on_stale=on_stale)
                try:
                    base.check()
                except ValueError as exc:
                    raise typer.BadParameter(str(exc)) from None
                cell = run_cell(base, layouts=STATIC, modes=modes, policies=pols,
                                seeds=range(1, seeds + 1), screen_seeds=screen_seeds,
                                train_ratios=ratios, jobs=jobs, sync_batches=batches,
                                colocated=colo, progress=lambda n: prog.advance(task, n))
                key = f"{w}/{band}"
                doc["cells"][key] = cell
                if json_out is not None:
                    json_out.write_text(json.dumps(doc, indent=1))
                prog.console.print(report(key, cell))


def report(key: str, cell: dict[str, Any]) -> str:
    sync = "  ".join(f"{lay} {s:.0f}s" for lay, s in cell["sync_rollout_s"].items())
    lines = [f"{key}: best static {cell['best_static']} (sync rollout per step: {sync})"]
    for ratio, part in cell["ratios"].items():
        lines.append(f"  trainer {float(ratio):g} x rollout = {part['train_s']:.0f} s per step; "
                     "trained tokens/h and x best static sync (paired 95% CI), then samples/h")
        for name, row in part["rows"].items():
            lines.append(f"    {name:34s} {_fmt(row)}")
    for job, rollouts in cell.get("colocated_rollout_s", {}).items():
        each = "  ".join(f"{lay} {s:.0f}s" for lay, s in rollouts.items())
        lines.append(f"  colocated {job}: sync rollout per step {each}")
    return "\n".join(lines)
