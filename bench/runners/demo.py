"""``rollout-gateway demo``: the main job on the embedded default, end to end.

Starts a simulated vLLM pool and the gateway (SQLite) in this process, runs a ``swe``-like
agentic batch through the official OpenAI client with live progress, then prints what a
user cares about: throughput, makespan, the slowest trajectories and where their time
went, and where to look next (status page, recorded traces).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from bench.harness.batch import BatchResult, HarnessConfig, TrajectoryResult, run_batch
from bench.harness.hosting import free_port, port_is_free, serve_gateway, sim_pool_process
from bench.workloads import generate
from gateway.config import ServerSettings, Settings


@dataclass(frozen=True, slots=True)
class DemoOptions:
    workload: str = "swe"
    prompts: int = 8
    group_size: int = 8
    instances: int = 8
    model: str = "qwen3-14b"
    gpu: str = "H100"
    speed: float = 15.0
    seed: int = 1
    port: int = 8000
    database_url: str | None = None
    keep: bool = False
    stream: bool = False
    max_context: int = 32768  # the model serves 40960; leave room for the chat template


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console)


async def _watch(progress: Progress, task: TaskID, gw: str, http: httpx.AsyncClient) -> None:
    while True:
        await asyncio.sleep(0.5)
        try:
            st = (await http.get(f"{gw}/status")).json()
        except httpx.HTTPError:
            continue
        phases = st["trajectories"]["by_phase"]
        detail = (f"generating {phases.get('generating', 0)}  tool {phases.get('tool', 0)}  "
                  f"queued {phases.get('queued', 0)}  traces {st['trace_writer']['written']}")
        progress.update(task, detail=detail)


async def _slowest(http: httpx.AsyncClient, gw: str, batch: BatchResult) -> Table:
    table = Table(title="Slowest trajectories (simulated seconds)")
    for col in ("trajectory", "turns", "tokens", "total", "LLM", "queued", "tool"):
        table.add_column(col, justify="right" if col != "trajectory" else "left")
    slow = sorted(batch.trajectories, key=lambda r: r.duration, reverse=True)[:5]
    for r in slow:
        live = (await http.get(f"{gw}/trajectories/{r.id}")).json().get("live") or {}
        sp = batch.speed
        table.add_row(r.id, str(len(r.turns)), str(r.output_tokens), f"{r.duration * sp:.0f}",
                      f"{live.get('llm_time_s', 0) * sp:.0f}",
                      f"{live.get('queue_time_s', 0) * sp:.0f}",
                      f"{live.get('tool_time_s', 0) * sp:.0f}")
    return table


def _summary(console: Console, batch: BatchResult) -> None:
    durations = sorted(r.duration * batch.speed for r in batch.trajectories)
    table = Table(title="Rollout batch", show_header=False)
    table.add_row("trajectories", f"{len(durations)} ({batch.errors} failed)")
    table.add_row("output tokens", f"{batch.output_tokens:,}")
    table.add_row("makespan", f"{batch.makespan_s:.0f} s (simulated)")
    table.add_row("throughput", f"{batch.output_tokens / batch.makespan_s:,.0f} tok/s")
    table.add_row("trajectory p50 / p99", f"{statistics.median(durations):.0f} s / "
                  f"{durations[min(len(durations) - 1, int(0.99 * len(durations)))]:.0f} s")
    console.print(table)
    errors = [r for r in batch.trajectories if r.error]
    if errors:
        console.print(f"[red]{len(errors)} trajectories failed[/], e.g. {errors[0].id}: "
                      f"{errors[0].error}")


async def run_demo(opts: DemoOptions, console: Console | None = None) -> BatchResult:
    console = console or Console()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-gateway-demo-"))
    db_url = opts.database_url or f"sqlite+aiosqlite:///{workdir / 'traces.db'}"
    port = opts.port if opts.port and port_is_free("127.0.0.1", opts.port) else free_port()
    specs = generate(opts.workload, opts.seed, prompts=opts.prompts, group_size=opts.group_size,
                     max_context=opts.max_context)
    console.print(f"[bold]rollout-gateway demo[/]: {len(specs)} '{opts.workload}' trajectories, "
                  f"{opts.instances} x simulated {opts.model} on {opts.gpu} (TP1), "
                  f"time compressed {opts.speed:g}x")
    pool = sim_pool_process(count=opts.instances, model=opts.model, gpu=opts.gpu,
                            speed=opts.speed, seed=opts.seed)
    async with pool as urls:
        settings = Settings(database_url=db_url, backends=urls,
                            server=ServerSettings(host="127.0.0.1", port=port),
                            traces={"spool_path": workdir / "spool.jsonl"})
        async with serve_gateway(settings) as gw, httpx.AsyncClient(timeout=30) as http:
            console.print(f"status page: [link]{gw}/[/]   traces: {db_url}")
            cfg = HarnessConfig(gateway_url=gw, model=opts.model, speed=opts.speed,
                                seed=opts.seed, stream=opts.stream)
            with _progress(console) as progress:
                task = progress.add_task("trajectories", total=len(specs), detail="")

                def done(_: TrajectoryResult) -> None:
                    progress.advance(task)

                watcher = asyncio.create_task(_watch(progress, task, gw, http))
                batch = await run_batch(specs, cfg, on_done=done)
                watcher.cancel()
            _summary(console, batch)
            lags = [(await http.get(f"{u}/sim/stats")).json()["lag_s"] for u in urls]
            console.print(f"simulation lag (time the 2-core host fell behind the simulated "
                          f"clock): max {max(lags):.1f} s of {batch.makespan_s:.0f} s")
            console.print(await _slowest(http, gw, batch))
            first = batch.trajectories[0].id
            sample = (await http.get(f"{gw}/trajectories/{first}/sample")).json()
            console.print(f"recorded trace of {first}: {len(sample['calls'])} calls, "
                          f"{len(sample['token_ids'])} tokens ({sum(sample['loss_mask'])} "
                          f"generated), mismatches: {len(sample['mismatches'])}  "
                          f"-> {gw}/trajectories/{first}/sample")
            if opts.keep:
                console.print(f"serving at {gw} (Ctrl-C to stop)")
                await asyncio.Event().wait()
    return batch
