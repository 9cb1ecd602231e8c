"""``rollout-gateway bench``: every benchmark command, registered on ``bench_app``.

``sim`` and ``soak`` are defined here; the others next to their runner or report. ``demo``
(a top-level command) is here too; ``rollout_gateway.cli`` mounts it and ``bench_app``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import TaskID

from bench.options import Gpu, Model, Progress, TpEfficiency, band_point, log_console
from bench.reports import gpu_scan, page, record, tail_cli
from bench.runners import grid_cli, learn, learn_two, live_cli, loop_cli, perf_cli

bench_app = typer.Typer(no_args_is_help=True)


@bench_app.command()
def sim(
    workload: Annotated[str, typer.Option(help="swe | search | math-code | tau")] = "swe",
    model: Model = "qwen3-14b",
    gpu: Gpu = "H100",
    tp_efficiency: TpEfficiency = "calibrated",
    gpus: Annotated[int, typer.Option(help="GPUs in the pool")] = 64,
    policy: Annotated[list[str] | None, typer.Option(help="repeatable; see docs/policies.md")]
    = None,
    seed: Annotated[int, typer.Option()] = 1,
    tp: Annotated[int, typer.Option(help="uniform TP of the baseline policies")] = 1,
    prompts: Annotated[int | None, typer.Option(help="fewer prompts (quick runs)")] = None,
    group_size: Annotated[int | None, typer.Option()] = None,
    cap_per_gpu: Annotated[int | None, typer.Option(
        help="gateway concurrency cap per GPU (default: none; the engine admits up to "
             "max_num_seqs=256 per instance, by token budget and KV room)")] = None,
    weight_update_every: Annotated[float | None, typer.Option(
        help="simulate a weight update every N seconds (default: none)")] = None,
    weight_update_mode: Annotated[str, typer.Option(
        help="wait | keep | abort-and-continue (docs/weight-updates.md)")] = "wait",
    weight_update_s: Annotated[float, typer.Option(
        help="seconds the update itself takes, engines paused (an assumption)")] = 5.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """Discrete-event simulation of one rollout batch under each policy."""
    from bench.reports.sim_table import table
    from bench.simulator.run import Bench, Scenario
    from bench.simulator.weights import check_schedule
    from gateway.policies.registry import ALL_NAMES, POLICY_NAMES, resolve_names

    names = resolve_names(policy or ["verl-tp8", "slime", "heddle", "libra", "progressive",
                                     "straggler-lane", "progressive-oracle"])
    unknown = [n for n in names if n not in ALL_NAMES]
    if unknown:
        raise typer.BadParameter(f"unknown policy {unknown}; available: {', '.join(POLICY_NAMES)}"
                                 " and static layouts such as slime-tp4, verl-tp8")
    try:
        check_schedule(weight_update_every, weight_update_mode, weight_update_s)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    sc = Scenario(workload, model, gpu, gpus, seed, tp, prompts, group_size, cap_per_gpu,
                  weight_update_every_s=weight_update_every,
                  weight_update_mode=weight_update_mode, weight_update_s=weight_update_s,
                  tp_efficiency=band_point(tp_efficiency, model, gpu))
    console = log_console(170)
    try:
        bench = Bench(sc)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    results = []
    with Progress(console=console, transient=False) as prog:
        for name in names:
            task = prog.add_task(name, total=len(bench.specs))
            results.append(bench.run(name, partial(_advance, prog, task)))
    console.print(table(sc, results, bench.lower_bound))
    if json_out is not None:
        doc = {"command": " ".join(["rollout-gateway", "bench", "sim", *sys.argv[3:]]),
               "scenario": sc.__dict__ if hasattr(sc, "__dict__") else _fields(sc),
               "trajectories": len(bench.specs),
               "results": {r.policy: r.as_dict() for r in results}}
        json_out.write_text(json.dumps(doc, indent=2))


@bench_app.command("steps")
def steps(
    workload: Annotated[str, typer.Option(help="swe | search | math-code | tau")] = "swe",
    policy: Annotated[list[str] | None, typer.Option(
        help="repeatable; default: static slime/verl TP1-TP8, heddle, libra, progressive, "
             "straggler-lane, progressive-oracle")] = None,
    gpus: Annotated[int, typer.Option()] = 64,
    model: Model = "qwen3-14b",
    gpu: Gpu = "H100",
    tp_efficiency: TpEfficiency = "calibrated",
    steps_: Annotated[int, typer.Option("--steps", help="RL steps per run")] = 5,
    seeds: Annotated[int, typer.Option(help="seeds 1..N")] = 5,
    per_gpu: Annotated[int | None, typer.Option(
        help="trajectories per GPU (sets the prompts per step)")] = None,
    group_size: Annotated[int | None, typer.Option()] = None,
    jobs: Annotated[int, typer.Option(help="seeds in parallel processes")] = 2,
    weight_update_every: Annotated[float | None, typer.Option(
        help="simulate a weight update every N seconds of each step (default: none)")] = None,
    weight_update_mode: Annotated[str, typer.Option(
        help="wait | keep | abort-and-continue (docs/weight-updates.md)")] = "wait",
    weight_update_s: Annotated[float, typer.Option(
        help="seconds the update itself takes, engines paused (an assumption)")] = 5.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """K-step RL runs over a resampled prompt pool, several seeds, 95% intervals."""
    from bench.simulator.steps import StepScenario, paired_ratio, run_seeds, summarize
    from bench.simulator.weights import check_schedule
    from bench.workloads import load_workloads
    from gateway.policies.registry import ALL_NAMES, resolve_names

    names = resolve_names(policy or [
        *(f"{b}-tp{t}" for b in ("slime", "verl") for t in (1, 2, 4, 8)),
        "heddle", "libra", "progressive", "straggler-lane", "progressive-oracle"])
    unknown = [n for n in names if n not in ALL_NAMES]
    if unknown:
        raise typer.BadParameter(f"unknown policy {unknown}")
    try:
        check_schedule(weight_update_every, weight_update_mode, weight_update_s)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    table = load_workloads()
    if workload not in table:
        raise typer.BadParameter(f"unknown workload {workload!r}")
    size = group_size or table[workload]["group_size"]
    prompts = max(1, per_gpu * gpus // size) if per_gpu else None
    base = StepScenario(workload, names[0], steps=steps_, gpus=gpus, model=model, gpu=gpu,
                        prompts=prompts, group_size=group_size,
                        weight_update_every_s=weight_update_every,
                        weight_update_mode=weight_update_mode, weight_update_s=weight_update_s,
                        tp_efficiency=band_point(tp_efficiency, model, gpu))
    res = summarize(run_seeds(base, names, range(1, seeds + 1), jobs))
    static = {n: r for n, r in res.items() if "-tp" in n}
    best = min(static, key=lambda n: static[n]["mean_s"]) if static else None
    lines = [f"{workload}, {model}/{gpu}, TP efficiency {tp_efficiency}, {gpus} GPUs, "
             f"{steps_} steps (steps 2-{steps_} reported), "
             f"{seeds} seeds; mean makespan per step +- 95% t-interval"]
    for n, r in sorted(res.items(), key=lambda kv: kv[1]["mean_s"]):
        vs = ""
        if best:
            g, lo, hi = paired_ratio(res[best]["per_seed_s"], r["per_seed_s"])
            r["vs_best_static"] = {"geomean": g, "ci95_low": lo, "ci95_high": hi}
            vs = f"  best static/this {g:.2f}x (paired 95% CI {lo:.2f}-{hi:.2f})"
        ws = (f"  updates {r['w_updates']:.1f}, paused {r['w_paused_s']:.0f} s, staleness "
              f"mean {r['w_mean_staleness']:.2f} max {r['w_max_staleness']:.1f}, stale tokens "
              f"{r['w_stale_token_frac']:.0%}" if "w_updates" in r else "")
        lines.append(f"  {n:14s} {r['mean_s']:8.1f} +- {r['ci95_s']:6.1f} s{vs}{ws}")
    any_r = next(iter(res.values()))
    bind = "critical path" if any_r["lb_critical_s"] >= any_r["lb_work_s"] else "total work"
    lines.append(f"  lower bound: critical path {any_r['lb_critical_s']:.1f} s, total work / "
                 f"capacity {any_r['lb_work_s']:.1f} s ({bind} binds)")
    typer.echo("\n".join(lines))
    if json_out is not None:
        doc = {"command": " ".join(["rollout-gateway", "bench", "steps", *sys.argv[3:]]),
               "best_static": best, "results": res}
        json_out.write_text(json.dumps(doc, indent=2))


def demo(
    prompts: Annotated[int, typer.Option(
        help="GRPO groups (prompts) in the batch (4 x 8 keeps a 2-core host within 5% of "
        "the simulated clock at ~6x)")] = 4,
    group_size: Annotated[int, typer.Option(help="trajectories per prompt")] = 8,
    instances: Annotated[int, typer.Option(help="simulated vLLM servers (TP1 at start)")] = 8,
    speed: Annotated[float, typer.Option(
        help="time compression of the simulation at the start; slowed while the host "
        "falls behind it (the summary says to what)")] = 15.0,
    workload: Annotated[str, typer.Option(help="swe, search, math-code or tau")] = "swe",
    port: Annotated[int, typer.Option(help="gateway port (a free one if taken)")] = 8000,
    keep: Annotated[bool, typer.Option("--keep", help="keep serving afterwards")] = False,
    seed: Annotated[int, typer.Option()] = 1,
    static_pool: Annotated[bool, typer.Option(
        "--static-pool", help="servers in a child process as a fixed pool (the policy's "
        "layout changes are not applied)")] = False,
    policy: Annotated[str, typer.Option(
        help="scheduling policy; progressive (default here) shows relayouts and migrations "
        "live, the gateway's own default is replay (it relays out between steps)")] = "progressive",
) -> None:
    """Gateway + simulated pool + an agentic batch through the OpenAI client, end to end."""
    from bench.runners.demo import DemoOptions, run_demo

    policy = live_cli.check_live_names([policy])[0]
    opts = DemoOptions(workload=workload, prompts=prompts, group_size=group_size,
                       instances=instances, speed=speed, seed=seed, port=port, keep=keep,
                       static_pool=static_pool, policy=policy)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_demo(opts))



def _advance(prog: Progress, task: TaskID, done: int) -> None:
    prog.update(task, completed=done)


def _fields(sc: object) -> dict[str, object]:
    return {k: getattr(sc, k) for k in getattr(sc, "__slots__", ())}


@bench_app.command("soak")
def soak(
    minutes: Annotated[float, typer.Option(help="length of the steady load")] = 10.0,
    concurrency: Annotated[int, typer.Option(help="trajectories in flight at once")] = 200,
    instances: Annotated[int, typer.Option(help="simulated vLLM servers")] = 4,
    speed: Annotated[float, typer.Option(help="time compression of the simulation")] = 20.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """Soak: a gateway process under steady agentic load; memory, tasks, fds, counters."""
    from bench.runners.soak import soak_command

    soak_command(minutes=minutes, concurrency=concurrency, instances=instances, speed=speed,
                 json_out=json_out)


# Benchmarks whose commands live next to their runners or reports; registered here, in one
# place, so that no runner or report module imports this one.
bench_app.command("overhead")(perf_cli.overhead)
bench_app.command("store")(perf_cli.store)
bench_app.command("headroom")(perf_cli.headroom)
bench_app.command("live")(live_cli.live)
bench_app.command("vllm-cpu")(live_cli.vllm_cpu)
bench_app.command("record")(record.record)
bench_app.command("tail")(tail_cli.tail)
bench_app.command("page")(page.page)
bench_app.command("grid")(grid_cli.grid)
bench_app.command("gpu-scan")(gpu_scan.gpu_scan)
bench_app.command("learn")(learn.learn)
bench_app.command("learn-two")(learn_two.learn_two)
bench_app.command("loop")(loop_cli.loop)
bench_app.command("split")(perf_cli.split)
bench_app.command("relay")(perf_cli.relay)
bench_app.command("routes")(perf_cli.routes)
bench_app.command("viewer")(perf_cli.viewer)
