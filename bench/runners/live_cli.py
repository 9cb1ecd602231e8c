"""``rollout-gateway bench live``: the command, its table, and its report files."""

from __future__ import annotations

import asyncio
import json
import platform
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from bench.options import log_console
from bench.reports.plots import completion_cdf, gantt, throughput_bars
from bench.runners.live import LivePass, LiveScenario, as_json, run_live
from gateway.policies.registry import LIVE_NAMES, ORACLE_NAMES, STATIC_NAMES, resolve_names

#: what these benchmarks run live (as before, without heddle-learned) and the static layouts
LIVE_POLICIES = tuple(n for n in LIVE_NAMES if n != "heddle-learned") + STATIC_NAMES


def check_live_names(names: list[str]) -> list[str]:
    """The names, old ones resolved to the current ones; a bad name is a usage error."""
    names = resolve_names(names)
    for n in names:
        if n in ORACLE_NAMES:
            raise typer.BadParameter(f"{n!r} cannot run live: it needs the benchmark's "
                                     "hidden lengths (use it in bench steps or bench sim)")
        if n not in LIVE_POLICIES:
            raise typer.BadParameter(f"unknown policy {n!r}; choose from "
                                     f"{', '.join(LIVE_POLICIES)}")
    return names


def _table(sc: LiveScenario, lb: float, passes: list[LivePass]) -> Table:
    t = Table(title=f"bench live: {sc.workload}, {sc.gpus} x {sc.model} on {sc.gpu} "
              f"(simulated, {sc.speed:g}x), lower bound {lb:.0f} s")
    cols = ("policy", "layout", "makespan s", "tok/s", "p50 s", "p99 s", "x LB",
            "queue/turn s", "cache hit", "GPU idle", "migr.", "relayouts", "sim makespan",
            "live vs sim")
    for c in cols:
        t.add_column(c, justify="left" if c in ("policy", "layout") else "right")
    for p in passes:
        t.add_row(p.label, "+".join(map(str, p.layout)), f"{p.makespan_s:.0f}",
                  f"{p.throughput_tok_s:,.0f}", f"{p.p50_trajectory_s:.0f}",
                  f"{p.p99_trajectory_s:.0f}", f"{p.makespan_s / lb:.2f}",
                  f"{p.queue_per_turn_mean_s:.2f}", f"{p.prefix_cache_hit_rate:.0%}",
                  f"{p.gpu_idle_fraction:.0%}", str(p.migrations), _relayouts(p),
                  f"{p.sim_makespan_s:.0f}", f"{p.live_vs_sim_diff:+.1%}")
    return t


def _relayouts(p: LivePass) -> str:
    """Applied / proposed live, the simulator's count, and the live drain + start cost."""
    text = f"{p.reconfigurations}/{p.relayouts_proposed} (sim {p.sim_reconfigurations})"
    if p.reconfigurations:
        text += f", drain {p.relayout_drain_s:.0f} s, start {p.relayout_start_s:.0f} s"
    return text


def write_report(out: Path, command: str, sc: LiveScenario, doc: dict[str, object],
                 passes: list[LivePass]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "live.json").write_text(json.dumps({"command": command, **doc}, indent=2))
    throughput_bars(out / "throughput.png", {p.label: p.throughput_tok_s for p in passes},
                    f"bench live: {sc.workload} throughput")
    completion_cdf(out / "cdf.png", {p.label: [r["end"] for r in p.trajectories]
                                     for p in passes}, "trajectory completion")
    for p in passes:
        gantt(out / f"gantt-{p.policy}.png", p.trajectories, f"slowest trajectories: {p.label}",
              relayouts=p.relayouts)
    lines = [f"Command: `{command}`", "",
             f"Machine: {platform.machine()}, {platform.system()} {platform.release()}, "
             f"Python {platform.python_version()}", "",
             "| policy | layout | makespan s | tok/s | p50 s | p99 s | x lower bound | "
             "queue/turn s | prefix hit | GPU idle | migrations | relayouts applied/proposed "
             "(sim) | sim makespan s | live vs sim |", "|" + "---|" * 14]
    lb = float(doc["lower_bound_makespan_s"])  # type: ignore[arg-type]
    for p in passes:
        lines.append(
            f"| {p.label} | {'+'.join(map(str, p.layout))} | {p.makespan_s:.0f} | "
            f"{p.throughput_tok_s:,.0f} | {p.p50_trajectory_s:.0f} | {p.p99_trajectory_s:.0f} "
            f"| {p.makespan_s / lb:.2f} | {p.queue_per_turn_mean_s:.2f} | "
            f"{p.prefix_cache_hit_rate:.0%} | {p.gpu_idle_fraction:.0%} | {p.migrations} | "
            f"{_relayouts(p)} | {p.sim_makespan_s:.0f} | {p.live_vs_sim_diff:+.1%} |")
    lines += ["", "![throughput](throughput.png) ![completion CDF](cdf.png)", ""]
    lines += [f"![gantt {p.policy}](gantt-{p.policy}.png)" for p in passes]
    (out / "live.md").write_text("\n".join(lines) + "\n")
    return out / "live.md"


def live(
    workload: Annotated[str, typer.Option(help="swe | search | math-code | tau")] = "swe",
    model: Annotated[str, typer.Option()] = "qwen3-14b",
    gpu: Annotated[str, typer.Option()] = "H100",
    gpus: Annotated[int, typer.Option(help="simulated GPUs in the pool")] = 8,
    policy: Annotated[list[str] | None, typer.Option(help="repeatable")] = None,
    speed: Annotated[float, typer.Option(help="time compression of the simulated pool")] = 10,
    seed: Annotated[int, typer.Option()] = 1,
    prompts: Annotated[int, typer.Option(help="GRPO groups in the batch")] = 8,
    group_size: Annotated[int, typer.Option()] = 8,
    cap_per_gpu: Annotated[int, typer.Option()] = 16,
    out: Annotated[Path, typer.Option(help="report directory")] = Path("artifacts/bench/live"),
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
    static_pool: Annotated[bool, typer.Option(
        "--static-pool", help="servers in child processes as a fixed pool (relayouts "
        "counted, not applied; the simulator ignores them too)")] = False,
) -> None:
    """Rollouts through the real gateway and harness on a simulated pool, per policy."""
    names = check_live_names(policy or ["slime", "progressive"])
    sc = LiveScenario(workload, model, gpu, gpus, speed, seed, prompts, group_size, cap_per_gpu,
                      static_pool=static_pool)
    console = log_console(180)
    console.print(f"bench live: {prompts * group_size} '{workload}' trajectories per pass, "
                  f"policies {names}, {speed:g}x time compression, "
                  f"{'static' if static_pool else 'managed'} pool")

    def done(p: LivePass, wall: float) -> None:
        console.print(f"  {p.label}: makespan {p.makespan_s:.0f} s, {p.throughput_tok_s:,.0f} "
                      f"tok/s, simulator {p.sim_makespan_s:.0f} s ({wall:.0f} s wall)")

    specs, lb, passes = asyncio.run(run_live(sc, names, done))
    console.print(_table(sc, lb, passes))
    doc = as_json(sc, specs, lb, passes)
    command = " ".join(["rollout-gateway", "bench", "live", *sys.argv[3:]])
    report = write_report(out, command, sc, doc, passes)
    if json_out is not None:
        json_out.write_text(json.dumps({"command": command, **doc}, indent=2))
    console.print(f"report: {report}")


def vllm_cpu(
    policy: Annotated[list[str] | None, typer.Option(help="repeatable")] = None,
    seed: Annotated[int, typer.Option()] = 1,
    prompts: Annotated[int, typer.Option(help="GRPO groups in the batch")] = 4,
    group_size: Annotated[int, typer.Option()] = 4,
    out: Annotated[Path, typer.Option(help="report directory")] = Path(
        "artifacts/bench/vllm-cpu"),
    json_out: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """The live benchmark against two real vLLM engines on CPU (tiny model)."""
    from bench.runners.vllm_cpu import prepare, run_vllm_cpu

    names = check_live_names(policy or ["slime", "progressive"])
    console = log_console(180)
    console.print(f"bench vllm-cpu: {prompts * group_size} trajectories per pass on two real "
                  f"vLLM CPU engines (tiny model), policies {names}; each pass starts fresh "
                  "engines (about a minute)")

    def done(p: LivePass) -> None:
        console.print(f"  {p.label}: makespan {p.makespan_s:.1f} s, "
                      f"{p.throughput_tok_s:,.0f} tok/s")

    try:
        python, workdir = prepare()
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc)) from None
    sc, specs, lb, passes = asyncio.run(run_vllm_cpu(
        names, python, workdir, seed=seed, prompts=prompts, group_size=group_size,
        on_pass=done))
    console.print(_table(sc, lb, passes))
    if len(passes) >= 2:
        base = passes[0]
        for p in passes[1:]:
            console.print(f"{p.label} vs {base.label}: makespan "
                          f"x{base.makespan_s / p.makespan_s:.2f}, throughput "
                          f"x{p.throughput_tok_s / base.throughput_tok_s:.2f}")
    doc = as_json(sc, specs, lb, passes)
    command = " ".join(["rollout-gateway", "bench", "vllm-cpu", *sys.argv[3:]])
    report = write_report(out, command, sc, doc, passes)
    if json_out is not None:
        json_out.write_text(json.dumps({"command": command, **doc}, indent=2))
    console.print(f"report: {report}")
