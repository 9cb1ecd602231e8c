"""``rollout-gateway demo``: the main job on the embedded default, end to end.

Starts the gateway (SQLite) with a managed pool of simulated vLLM servers in this
process, runs a ``swe``-like agentic batch through the official OpenAI client with live
progress, then prints what a user cares about: throughput, makespan, the slowest
trajectories and where their time went, the layout changes the policy made (each one a
real drain, stop and simulated start-up of the instances involved), and where to look
next (status page, recorded traces). ``static_pool`` runs the servers in a child process
instead, as a fixed pool the policy cannot change.

Everything shares this process, so on a small host it can fall behind the compressed
clock, and then the makespan would be the host's. The managed pool's servers and the
agents run on one shared clock that :class:`~bench.harness.governor.Governor` slows when
the servers lag with the event loop saturated; the summary prints the clock's speeds and
the lag. On the 2-core machine the default batch (32 swe trajectories) settles near 6x
with 3.5% lag; 64 trajectories settle near 2-3x.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

from backends.sim.clock import WallClock, release_clock, shared_clock
from bench.harness.batch import BatchResult, HarnessConfig, TrajectoryResult, run_batch
from bench.harness.governor import Governor
from bench.harness.hosting import (
    free_port,
    pool_settings,
    port_is_free,
    rare_full_collections,
    serve_gateway,
    sim_pool_process,
    wait_routable,
)
from bench.workloads import TrajectorySpec, generate
from gateway.app import create_app
from gateway.config import DispatchSettings, ServerSettings, Settings

_RUNS = itertools.count()


@dataclass(frozen=True, slots=True)
class DemoOptions:
    workload: str = "swe"
    prompts: int = 4
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
    #: ``progressive``, not the gateway's default ``replay``: the demo is one batch, and
    #: ``progressive`` changes the pool's TP layout and migrates within a batch (``replay``
    #: chooses its layout between steps, from the step it watched)
    policy: str = "progressive"
    max_context: int = 32768  # the model serves 40960; leave room for the chat template
    static_pool: bool = False  # servers in a child process; layout changes not applied


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console)


async def _watch(progress: Progress, task: TaskID, gw: str, http: httpx.AsyncClient,
                 clock: WallClock | None) -> None:
    while True:
        await asyncio.sleep(0.5)
        try:
            st = (await http.get(f"{gw}/status")).json()
        except httpx.HTTPError:
            continue
        phases, rl = st["trajectories"]["by_phase"], st["relayouts"]
        detail = (f"generating {phases.get('generating', 0)}  tool {phases.get('tool', 0)}  "
                  f"queued {phases.get('queued', 0)}  traces {st['trace_writer']['written']}  "
                  f"relayouts {rl['applied']}/{rl['proposed']}"
                  + (f"  clock {clock.speed:.1f}x" if clock else ""))
        progress.update(task, detail=detail)


async def _slowest(http: httpx.AsyncClient, gw: str, batch: BatchResult, scale: float
                   ) -> Table:
    """The five slowest trajectories; the gateway's wall seconds times ``scale``."""
    table = Table(title="Slowest trajectories (simulated seconds)")
    table.caption = "setup and reward: the harness's; LLM, queued and tool: the gateway's record"
    for col in ("trajectory", "turns", "tokens", "total", "setup", "LLM", "queued", "tool",
                "reward"):
        table.add_column(col, justify="right" if col != "trajectory" else "left",
                         no_wrap=col == "trajectory")
    slow = sorted(batch.trajectories, key=lambda r: r.duration, reverse=True)[:5]
    for r in slow:
        live = (await http.get(f"{gw}/trajectories/{r.id}")).json().get("live") or {}
        sp = batch.speed
        table.add_row(r.id, str(len(r.turns)), str(r.output_tokens), f"{r.duration * sp:.0f}",
                      f"{r.setup_s * sp:.0f}", f"{live.get('llm_time_s', 0) * scale:.0f}",
                      f"{live.get('queue_time_s', 0) * scale:.0f}",
                      f"{live.get('tool_time_s', 0) * scale:.0f}", f"{r.reward_s * sp:.0f}")
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


def _relayouts(console: Console, rl: dict[str, Any], speed: float) -> None:
    """The policy's layout changes: how many were applied and what they cost."""
    if not rl["proposed"]:
        console.print("relayouts: the policy proposed no layout change")
        return
    console.print(f"relayouts (TP changes applied live): {rl['applied']} applied of "
                  f"{rl['proposed']} proposed ({rl['refused']} refused, {rl['failed']} failed); "
                  f"drain {rl['drain_s'] * speed:.1f} s, stop {rl['stop_s'] * speed:.1f} s, "
                  f"start {rl['start_s'] * speed:.1f} s simulated in all")
    for r in rl["recent"]:
        console.print(f"  {'+'.join(r['retire'])} -> TP{'+'.join(map(str, r['launch']))} "
                      f"({r['reason']}): {r['status']}, drain {r['drain_s'] * speed:.1f} s, "
                      f"start {r['start_s'] * speed:.1f} s")
    if rl["last_refusal"]:
        console.print(f"  last refusal: {rl['last_refusal']['refused']}")


async def _sim_lags(http: httpx.AsyncClient, gw: str) -> dict[str, float]:
    """Each running simulated server's lag (``/sim/stats``), by URL."""
    lags: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        for b in (await http.get(f"{gw}/status")).json()["backends"]:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                lags[b["url"]] = float((await http.get(f"{b['url']}/sim/stats")).json()["lag_s"])
    return lags


def _pool(opts: DemoOptions, workdir: Path, clock: str | None
          ) -> contextlib.AbstractAsyncContextManager[dict[str, Any]]:
    """Settings fields for the pool: a managed one on the shared ``clock``, or a static
    child process."""
    static = sim_pool_process(count=opts.instances, model=opts.model, gpu=opts.gpu,
                              speed=opts.speed, seed=opts.seed) if opts.static_pool else None
    return pool_settings(workdir / "pool.json", [1] * opts.instances, model=opts.model,
                         gpu=opts.gpu, speed=opts.speed, seed=opts.seed, static=static,
                         clock=clock)


async def run_demo(opts: DemoOptions, console: Console | None = None) -> BatchResult:
    console = console or Console()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-gateway-demo-"))
    db_url = opts.database_url or f"sqlite+aiosqlite:///{workdir / 'traces.db'}"
    port = opts.port if opts.port and port_is_free("127.0.0.1", opts.port) else free_port()
    specs = generate(opts.workload, opts.seed, prompts=opts.prompts, group_size=opts.group_size,
                     max_context=opts.max_context)
    kind = "static pool" if opts.static_pool else "managed pool"
    console.print(f"[bold]rollout-gateway demo[/]: {len(specs)} '{opts.workload}' trajectories, "
                  f"{kind} of {opts.instances} x simulated {opts.model} on {opts.gpu} (TP1), "
                  f"time compressed {opts.speed:g}x, policy '{opts.policy}'")
    # a managed pool's servers share one clock with the agents, which the governor slows
    # when this process falls behind it (a static pool's child process keeps its own)
    clock_name = None if opts.static_pool else f"demo-{os.getpid()}-{next(_RUNS)}"
    clock = shared_clock(clock_name, opts.speed) if clock_name else None
    try:
        with rare_full_collections():
            async with _pool(opts, workdir, clock_name) as pool:
                settings = Settings(database_url=db_url, policy=opts.policy,
                                    server=ServerSettings(host="127.0.0.1", port=port),
                                    dispatch=DispatchSettings(time_scale=opts.speed),
                                    traces={"spool_path": workdir / "spool.jsonl"}, **pool)
                app = create_app(settings)
                async with serve_gateway(settings, app) as gw, \
                        httpx.AsyncClient(timeout=30) as http:
                    return await _run(opts, console, specs, gw, db_url, http, clock,
                                      app.state.runtime.dispatcher.scheduler.set_time_scale)
    finally:
        if clock_name:
            release_clock(clock_name)


async def _run(opts: DemoOptions, console: Console, specs: list[TrajectorySpec], gw: str,
               db_url: str, http: httpx.AsyncClient, clock: WallClock | None,
               set_time_scale: Callable[[float], None]) -> BatchResult:
    await wait_routable(http, gw, opts.instances)
    console.print(f"status page: [link]{gw}/[/]   trajectory viewer: [link]{gw}/view/search[/]"
                  f"   traces: {db_url}")
    cfg = HarnessConfig(gateway_url=gw, model=opts.model, speed=opts.speed, seed=opts.seed,
                        stream=opts.stream, clock=clock)
    governor = Governor(clock, on_speed=set_time_scale) if clock else None
    with _progress(console) as progress:
        task = progress.add_task("trajectories", total=len(specs), detail="")

        def done(_: TrajectoryResult) -> None:
            progress.advance(task)

        watcher = asyncio.create_task(_watch(progress, task, gw, http, clock))
        governing = asyncio.create_task(governor.run()) if governor else None
        wall0 = time.monotonic()
        try:
            batch = await run_batch(specs, cfg, on_done=done)
        finally:
            watcher.cancel()
            if governing is not None:
                governing.cancel()
        wall_s = time.monotonic() - wall0
        if governing is not None and governing.done() and not governing.cancelled():
            governing.result()  # it died during the run: its error, not a quiet summary
    # the gateway records wall seconds: at the run's mean compression they are simulated
    scale = batch.makespan_s / wall_s if wall_s > 0 else opts.speed
    _summary(console, batch)
    st = (await http.get(f"{gw}/status")).json()
    _relayouts(console, st["relayouts"], scale)
    if governor is not None:
        lag = governor.behind_s
        console.print(f"simulated clock: {governor.describe()}; the servers fell behind it "
                      f"by {lag:.1f} s of {batch.makespan_s:.0f} s "
                      f"({lag / max(batch.makespan_s, 1e-9):.1%})")
    else:
        lag = max((await _sim_lags(http, gw)).values(), default=0.0)
        console.print(f"simulation lag (time the host fell behind the simulated clock): "
                      f"max {lag:.1f} s of {batch.makespan_s:.0f} s")
    console.print(await _slowest(http, gw, batch, scale))
    first = batch.trajectories[0].id
    sample = (await http.get(f"{gw}/trajectories/{first}/sample")).json()
    console.print(f"recorded trace of {first}: {len(sample['calls'])} calls, "
                  f"{len(sample['token_ids'])} tokens ({sum(sample['loss_mask'])} "
                  f"generated), mismatches: {len(sample['mismatches'])}  "
                  f"-> {gw}/trajectories/{first}/sample, read in {gw}/view/trajectories/{first}")
    if opts.keep:
        console.print(f"serving at {gw} (Ctrl-C to stop)")
        await asyncio.Event().wait()
    return batch
