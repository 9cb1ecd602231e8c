"""``rollout-gateway bench grid``: a policy against every uniform static layout across
models, GPUs, loads, workloads and the TP-efficiency band (bench/runners/grid.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer


def grid(
    json_out: Annotated[Path, typer.Option("--json", help="results (written as they come)")],
    model: Annotated[list[str] | None, typer.Option(help="repeatable; default qwen3-14b")]
    = None,
    gpu: Annotated[list[str] | None, typer.Option(help="repeatable; default H100")] = None,
    gpus: Annotated[list[int] | None, typer.Option(help="repeatable pool sizes; default 16")]
    = None,
    per_gpu: Annotated[list[int] | None, typer.Option(
        help="repeatable trajectories per GPU; default 4 and 16")] = None,
    workload: Annotated[list[str] | None, typer.Option(
        help="repeatable; default swe, search, math-code, tau")] = None,
    tp_efficiency: Annotated[list[str] | None, typer.Option(
        "--tp-efficiency", help="repeatable band points; default low, mid, high")] = None,
    policy: Annotated[list[str] | None, typer.Option(
        help="repeatable; default verl-tp1..8, heddle, libra, straggler-lane, replay")] = None,
    seeds: Annotated[int, typer.Option(help="seeds 1..N")] = 3,
    steps_: Annotated[int, typer.Option("--steps", help="RL steps per run (step 1 is cold)")]
    = 2,
    jobs: Annotated[int, typer.Option(help="processes")] = 2,
    resume: Annotated[bool, typer.Option(help="keep the runs already in --json")] = False,
    beliefs: Annotated[str, typer.Option(
        help="what policies know of each TP's speed: live (the calibrated profile, corrected "
             "by what the engines measured, as a live gateway) or true (the band's own)")]
    = "live",
) -> None:
    """Every cell of the grid: each policy's paired speed-up over the best static layout."""
    from bench.options import Progress, band_point
    from bench.runners.grid import RIVALS, STATIC, SUBJECT, cells, fmt_ratio, run_grid, verdicts
    from bench.workloads import load_workloads
    from gateway.policies.registry import ALL_NAMES, resolve_names

    names = resolve_names(policy or [*STATIC, *RIVALS, SUBJECT])
    bad = [n for n in names if n not in ALL_NAMES]
    if bad:
        raise typer.BadParameter(f"unknown policy {bad}")
    if not any(n in STATIC for n in names):
        raise typer.BadParameter(f"the grid needs at least one static layout ({', '.join(STATIC)})")
    table = load_workloads()
    wls = workload or ["swe", "search", "math-code", "tau"]
    unknown = [w for w in wls if w not in table]
    if unknown:
        raise typer.BadParameter(f"unknown workload {unknown}; available: {', '.join(table)}")
    from bench.simulator.speeds import BELIEFS

    if beliefs not in BELIEFS:
        raise typer.BadParameter(f"--beliefs must be one of {', '.join(BELIEFS)}")
    if steps_ < 2:
        raise typer.BadParameter("--steps must be at least 2 (step 1 is not reported)")
    models, kinds = model or ["qwen3-14b"], gpu or ["H100"]
    bands = tp_efficiency or ["low", "mid", "high"]
    for m in models:
        for k in kinds:
            for b in bands:
                band_point(b, m, k)  # a bad model, GPU or band is a usage error up front
    todo = cells(models, kinds, gpus or [16], per_gpu or [4, 16], wls, bands)
    with Progress(transient=False) as prog:
        task = prog.add_task(f"{len(todo)} cells x {len(names)} policies x {seeds} seeds",
                             total=None)
        try:
            doc = run_grid(todo, names, range(1, seeds + 1), steps_, json_out, jobs, resume,
                           progress=lambda d, t: prog.update(task, completed=d, total=t),
                           beliefs=beliefs)
        except ValueError as exc:  # a resumed file run with other beliefs
            raise typer.BadParameter(str(exc)) from None
    args = [a for a in sys.argv[3:] if a != "--resume"]  # the command that makes the file
    doc["command"] = " ".join(["rollout-gateway", "bench", "grid", *args])
    json_out.write_text(json.dumps(doc, indent=1))
    from bench.reports.plots import grid_heatmap

    figure = grid_heatmap(json_out.with_suffix(".png"), doc["summary"], SUBJECT,
                          f"{SUBJECT} vs the best static layout, {', '.join(models)} on "
                          f"{', '.join(kinds)}, {', '.join(map(str, gpus or [16]))} GPUs")
    typer.echo(f"heat map: {figure}")
    for key, row in doc["summary"].items():
        ratios = "  ".join(f"{p} {fmt_ratio(row.get(f'{p}_vs_best_static'))}"
                           for p in names if p not in STATIC)
        typer.echo(f"{key}: best static {row['best_static']}  {ratios}")
    typer.echo(f"verdicts: {verdicts(doc['summary'])}")
