"""Write benchmark sections of ``BENCHMARKS.md`` from the JSON a run produced.

Figures in ``BENCHMARKS.md`` are never typed in: ``rollout-gateway bench record`` turns
the JSON files of real runs (``bench sim --json``, ``bench live --json``,
``bench vllm-cpu --json``) into markdown tables, copies their plots next to the file, and
replaces only the sections it owns.
"""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.reports.perf import write_section


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def sim_markdown(doc: dict[str, Any]) -> str:
    res = doc["results"]
    base = res.get("slime", next(iter(res.values())))["throughput_tok_s"]
    lb = next(iter(res.values()))["lower_bound_makespan_s"]
    rows = [f"`{doc['command']}` ({doc['trajectories']} trajectories, lower bound "
            f"{lb:.0f} s)", "",
            "| policy | makespan s | x LB | tok/s | x slime | p50 s | p99 s | migrations | "
            "reconf | cache hit | rank corr | tail recall | wall s |", "|" + "---|" * 13]
    for r in res.values():
        rows.append(
            f"| {r['label']} | {r['makespan_s']:.0f} | {r['makespan_s'] / lb:.2f} | "
            f"{r['throughput_tok_s']:,.0f} | {r['throughput_tok_s'] / base:.2f} | "
            f"{r['p50_trajectory_s']:.0f} | {r['p99_trajectory_s']:.0f} | {r['migrations']} | "
            f"{r['reconfigurations']} | {_pct(r['prefix_cache_hit_rate'])} | "
            f"{_num(r['rank_corr'])} | {_num(r['tail_recall'])} | {r['wall_s']:.0f} |")
    return "\n".join(rows)


def live_markdown(doc: dict[str, Any], plots_rel: str | None) -> str:
    res, lb = doc["results"], doc["lower_bound_makespan_s"]
    sc = doc["scenario"]
    lines = [f"`{doc['command']}`", "",
             f"{doc['trajectories']} '{sc['workload']}' trajectories on {sc['gpus']} x "
             f"{sc['model']} ({sc['gpu']}), time compression {sc['speed']:g}x, cap "
             f"{sc['cap_per_gpu']}/GPU; lower bound {lb:.0f} s.", "",
             "| policy | layout | makespan s | tok/s | p50 s | p99 s | x LB | queue/turn s | "
             "prefix hit | GPU idle | migrations | sim makespan s | live vs sim |",
             "|" + "---|" * 13]
    for r in res.values():
        lines.append(
            f"| {r['label']} | {'+'.join(map(str, r['layout']))} | {r['makespan_s']:.1f} | "
            f"{r['throughput_tok_s']:,.0f} | {r['p50_trajectory_s']:.1f} | "
            f"{r['p99_trajectory_s']:.1f} | {r['makespan_s'] / lb:.2f} | "
            f"{r['queue_per_turn_mean_s']:.2f} | {_pct(r['prefix_cache_hit_rate'])} | "
            f"{_pct(r['gpu_idle_fraction'])} | {r['migrations']} | {r['sim_makespan_s']:.1f} | "
            f"{r['live_vs_sim_diff']:+.1%} |")
    names = list(res)
    if "slime" in res and len(names) > 1:
        base = res["slime"]
        for n in names:
            if n != "slime":
                speedup = res[n]["throughput_tok_s"] / base["throughput_tok_s"]
                lines += ["", f"{res[n]['label']} vs slime: makespan "
                          f"x{base['makespan_s'] / res[n]['makespan_s']:.2f}, "
                          f"throughput x{speedup:.2f}."]
    if plots_rel:
        lines += ["", f"![throughput]({plots_rel}/throughput.png) "
                  f"![completion CDF]({plots_rel}/cdf.png)", ""]
        lines += [f"![gantt {n}]({plots_rel}/gantt-{n}.png)" for n in names]
    return "\n".join(lines)


def _copy_plots(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for png in src.glob("*.png"):
        shutil.copy(png, dest / png.name)


def record(
    benchmarks: Annotated[Path, typer.Argument(help="BENCHMARKS.md to update")],
    sim: Annotated[list[Path] | None, typer.Option(help="bench sim --json files")] = None,
    live: Annotated[Path | None, typer.Option(help="bench live --json file")] = None,
    live_plots: Annotated[Path | None, typer.Option(help="bench live --out dir")] = None,
    vllm_cpu: Annotated[Path | None, typer.Option(help="bench vllm-cpu --json file")] = None,
    vllm_cpu_plots: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Write the results sections of BENCHMARKS.md from the JSON of real runs."""
    machine = (f"Machine: {platform.machine()} {platform.system()} {platform.release()}, "
               f"Python {platform.python_version()} (2-core development VM).")
    if sim:
        body = [machine, ""]
        for f in sim:
            doc = json.loads(f.read_text())
            body += [f"### {doc['scenario']['workload']}", "", sim_markdown(doc), ""]
        write_section(benchmarks, "bench sim: results", "\n".join(body))
    for heading, jf, plots, name in (("bench live", live, live_plots, "live"),
                                     ("bench vllm-cpu", vllm_cpu, vllm_cpu_plots, "vllm-cpu")):
        if jf is None:
            continue
        rel = None
        if plots is not None:
            dest = benchmarks.parent / "docs" / "benchmarks" / name
            _copy_plots(plots, dest)
            rel = str(dest.relative_to(benchmarks.parent))
        write_section(benchmarks, heading, machine + "\n\n" +
                      live_markdown(json.loads(jf.read_text()), rel))
    typer.echo(f"updated {benchmarks}")
