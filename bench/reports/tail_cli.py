"""``rollout-gateway bench tail``: what a step's longest trajectories cost on their own,
and what that leaves a policy to gain over a ``bench steps`` run (bench/simulator/tail.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.options import Gpu, Model, Progress, TpEfficiency, band_point


def tail(
    workload: Annotated[str, typer.Option(help="swe | search | math-code | tau")] = "search",
    gpus: Annotated[int, typer.Option()] = 64,
    model: Model = "qwen3-14b",
    gpu: Gpu = "H100",
    tp_efficiency: TpEfficiency = "calibrated",
    per_gpu: Annotated[int | None, typer.Option(
        help="trajectories per GPU (sets the prompts per step)")] = None,
    group_size: Annotated[int | None, typer.Option()] = None,
    steps_: Annotated[int, typer.Option("--steps", help="RL steps per run")] = 5,
    seeds: Annotated[int, typer.Option(help="seeds 1..N")] = 5,
    top: Annotated[list[int] | None, typer.Option(
        help="repeatable: keep the k longest trajectories of each step; default: 1/16, "
             "1/8, 1/4 and 1/2 of the step")] = None,
    layout: Annotated[list[str] | None, typer.Option(
        help="repeatable: layouts or policies tried for each subset (default verl-tp8, "
             "verl-tp4; a perfect-predictor policy is allowed here)")] = None,
    against: Annotated[list[Path] | None, typer.Option(
        help="repeatable: `bench steps --json` files of the same runs (workload, GPUs, "
             "batch, steps, seeds): compare their policies with the estimate")] = None,
    target: Annotated[float, typer.Option(
        help="speed-up over the best static layout to test for reach")] = 1.15,
    jobs: Annotated[int, typer.Option(help="processes")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """The k longest trajectories of each step, alone: how much of the makespan they set."""
    from bench.simulator.steps import StepScenario, interval, paired_ratio
    from bench.simulator.tail import DEFAULT_LAYOUTS, run_tail
    from bench.workloads import load_workloads
    from gateway.policies.registry import ALL_NAMES, resolve_names

    table = load_workloads()
    if workload not in table:
        raise typer.BadParameter(f"unknown workload {workload!r}; available: "
                                 f"{', '.join(sorted(table))}")
    layouts = resolve_names(layout or DEFAULT_LAYOUTS)
    bad = [n for n in layouts if n not in ALL_NAMES]
    if bad:
        raise typer.BadParameter(f"not a layout or policy: {bad}")
    if steps_ < 2:
        raise typer.BadParameter("--steps must be at least 2 (step 1 is not reported)")
    size = group_size or table[workload]["group_size"]
    prompts = max(1, per_gpu * gpus // size) if per_gpu else table[workload]["prompts"]
    n = prompts * size
    ks = sorted(set(top or [max(1, n // d) for d in (16, 8, 4, 2)]))
    if ks[0] < 1 or ks[-1] > n:
        raise typer.BadParameter(f"--top must be between 1 and the step's {n} trajectories")
    base_runs = _load_against(against) if against else None
    base = StepScenario(workload, layouts[0], steps=steps_, gpus=gpus, model=model, gpu=gpu,
                        prompts=prompts, group_size=group_size,
                        tp_efficiency=band_point(tp_efficiency, model, gpu))
    with Progress(transient=False) as prog:
        task = prog.add_task(f"{workload}: subsets", total=1)
        res = run_tail(base, ks, layouts, range(1, seeds + 1), jobs,
                       progress=lambda done, total: prog.update(task, completed=done,
                                                                total=total))
    m, h = interval(list(res.estimate.values()))
    lines = [f"{workload}, {gpus} GPUs, {n} trajectories per step, steps 2-{steps_}, {seeds} "
             "seeds: the k longest of each step alone, mean makespan s"]
    widths = [max(12, len(p) + 2) for p in layouts]
    lines.append("  " + f"{'k':>6s}" + "".join(f"{p:>{w}s}" for p, w in zip(layouts, widths,
                                                                        strict=True)))
    for k in ks:
        lines.append("  " + f"{k:>6d}" + "".join(f"{res.mean(k, p):{w}.1f}" for p, w in
                                                 zip(layouts, widths, strict=True)))
    lines.append(f"  estimate (per step, the largest k's fastest layout): {m:.1f} +- {h:.1f} s")
    doc: dict[str, Any] = {
        "command": " ".join(["rollout-gateway", "bench", "tail", *sys.argv[3:]]),
        "trajectories_per_step": n, "ks": ks, "layouts": layouts,
        "estimate_s": {"mean": m, "ci95": h, "per_seed_s": res.estimate},
        "per_k": {f"{k}:{p}": {s: v[(k, p)] for s, v in res.per_seed.items()}
                  for k in ks for p in layouts}}
    if base_runs is not None:
        best, runs = base_runs
        lines.append("  against the `bench steps` runs (paired by seed; x = makespan / estimate):")
        doc["against"] = {}
        for name, per_seed in sorted(runs.items(), key=lambda kv: sum(kv[1].values())):
            g, lo, hi = paired_ratio(per_seed, res.estimate)
            doc["against"][name] = {"geomean": g, "ci95_low": lo, "ci95_high": hi}
            lines.append(f"    {name:18s} {g:.2f}x the estimate (95% CI {lo:.2f}-{hi:.2f})")
        if best in runs:
            need = paired_ratio(runs[best], res.estimate)[0] / target
            doc["target"] = {"speedup": target, "needs_x_estimate": need}
            verdict = "below the estimate: out of reach" if need < 1 else "above the estimate"
            lines.append(f"  {target:.2f}x over {best} needs {need:.2f}x the estimate "
                         f"({verdict})")
    typer.echo("\n".join(lines))
    if json_out is not None:
        json_out.write_text(json.dumps(doc, indent=2))


def _load_against(paths: list[Path]) -> tuple[str | None, dict[str, dict[str, float]]]:
    """Per-seed makespans by policy from ``bench steps`` files, and the first best static
    layout they name."""
    from gateway.policies.registry import DEPRECATED_NAMES

    best: str | None = None
    runs: dict[str, dict[str, float]] = {}
    for path in paths:
        try:
            doc = json.loads(path.read_text())
            runs.update({  # files recorded before the rename name policies the old way
                DEPRECATED_NAMES.get(name, name): {
                    str(s): float(v) for s, v in row["per_seed_s"].items()}
                for name, row in doc["results"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise typer.BadParameter(f"{path}: not a `bench steps --json` file with per-seed "
                                     f"makespans ({exc})") from None
        best = best or doc.get("best_static")
    return best, runs
