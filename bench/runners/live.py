"""``rollout-gateway bench live``: real rollouts through the gateway, one pass per policy.

Each pass starts a fresh simulated vLLM pool (child processes, time compressed by
``speed``) laid out as the policy's initial layout, a fresh gateway in this process with
that policy, and the emulated agent harness (official OpenAI client per trajectory) on
the same seeded batch. It reports what ``bench sim`` reports, plus what only a live run
shows: gateway-side queueing per turn, the engines' prefix-cache hit rate, and how idle
the GPUs were (sampled engine occupancy). The same batch then runs through the
discrete-event simulator under the same constraints, and the makespan difference
between the two says how far the simulator can be trusted.

The live pool is not a managed pool, so layout changes a policy proposes are not
applied; the simulator reference run ignores them too (``FixedLayout``), and both
report how many were proposed.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness.batch import BatchResult, HarnessConfig, run_batch
from bench.harness.hosting import free_port, serve_gateway, sim_pool_process
from bench.simulator.des import SimConfig, Simulator
from bench.simulator.metrics import lower_bound
from bench.simulator.speeds import profiles, speeds
from bench.workloads import TrajectorySpec, generate
from gateway.config import DispatchSettings, ServerSettings, Settings
from gateway.dispatch.scrape import EngineSample, parse_vllm_metrics
from gateway.policies.base import Policy, Relayout, Snapshot
from gateway.policies.registry import get_policy


@dataclass(frozen=True, slots=True)
class LiveScenario:
    workload: str = "swe"
    model: str = "qwen3-14b"
    gpu: str = "H100"
    gpus: int = 8
    speed: float = 10.0
    seed: int = 1
    prompts: int | None = 8
    group_size: int | None = 8
    cap_per_gpu: int = 16
    max_context: int = 32768
    database_url: str | None = None


@dataclass(slots=True)
class LivePass:
    policy: str
    label: str
    layout: list[int]
    makespan_s: float
    throughput_tok_s: float
    p50_trajectory_s: float
    p99_trajectory_s: float
    lower_bound_makespan_s: float
    migrations: int
    reconfigurations: int
    relayouts_proposed: int
    queue_per_turn_mean_s: float
    queue_per_turn_p99_s: float
    prefix_cache_hit_rate: float
    gpu_idle_fraction: float
    sim_lag_s: float
    failed_trajectories: int
    sim_makespan_s: float = 0.0
    live_vs_sim_diff: float = 0.0
    trajectories: list[dict[str, Any]] = field(default_factory=list)


class FixedLayout:
    """A policy whose layout changes are computed but not applied (placers still refresh)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.proposed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def plan(self, snap: Snapshot) -> Relayout | None:
        if self.inner.plan(snap) is not None:
            self.proposed += 1
        return None


@contextlib.asynccontextmanager
async def pool_for(layout: Sequence[int], sc: LiveScenario) -> AsyncIterator[list[str]]:
    """One ``sim-backend`` process per TP degree of ``layout``; yields ``URL#tp=N`` specs."""
    by_tp: dict[int, int] = {}
    for tp in layout:
        by_tp[tp] = by_tp.get(tp, 0) + 1
    async with contextlib.AsyncExitStack() as stack:
        specs: list[str] = []
        for i, (tp, count) in enumerate(sorted(by_tp.items())):
            urls = await stack.enter_async_context(sim_pool_process(
                count=count, model=sc.model, gpu=sc.gpu, tp=tp, speed=sc.speed,
                seed=sc.seed * 100 + i))
            specs += [f"{u}#tp={tp}" for u in urls]
        yield specs


async def _engines(http: httpx.AsyncClient, urls: list[str]) -> list[EngineSample]:
    """vLLM's own gauges and counters from each backend's ``/metrics`` (sim or real)."""
    out = []
    for u in urls:
        try:
            out.append(parse_vllm_metrics((await http.get(f"{u}/metrics")).text))
        except httpx.HTTPError:
            out.append(EngineSample())
    return out


async def _sample_engines(http: httpx.AsyncClient, urls: list[str],
                          samples: list[tuple[int, int]], stop: asyncio.Event) -> None:
    """(idle instances, instances) every 0.2 s of real time, for the idle fraction."""
    while not stop.is_set():
        engines = await _engines(http, urls)
        samples.append((sum(1 for e in engines if not e.running and not e.waiting),
                        len(engines)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def _engine_totals(http: httpx.AsyncClient, urls: list[str]) -> tuple[float, float]:
    """Prefix-cache hit rate over the pass, and the simulated pool's worst clock lag."""
    engines = await _engines(http, urls)
    hits = sum(e.prefix_hits or 0.0 for e in engines)
    queries = sum(e.prefix_queries or 0.0 for e in engines)
    lag = 0.0
    for u in urls:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            resp = await http.get(f"{u}/sim/stats")
            if resp.status_code == 200:
                lag = max(lag, float(resp.json()["lag_s"]))
    return (hits / queries if queries else 0.0), lag


async def _queues(http: httpx.AsyncClient, gw: str, ids: list[str],
                  speed: float) -> dict[str, list[float]]:
    """Gateway-side queueing of every call, per trajectory (simulated seconds)."""
    out: dict[str, list[float]] = {}
    for tid in ids:
        calls = (await http.get(f"{gw}/trajectories/{tid}")).json()["calls"]
        out[tid] = [c["queued_ms"] / 1000 * speed for c in calls if c["status"] == "ok"]
    return out


def _timeline(batch: BatchResult, queues: Mapping[str, list[float]]) -> list[dict[str, Any]]:
    """Per trajectory: span, and each turn split into gateway queueing and LLM time."""
    sp, t0 = batch.speed, batch.start
    rows = []
    for r in batch.trajectories:
        q = queues.get(r.id, [])
        queue, llm = [], []
        for i, t in enumerate(r.turns):
            s, e = (t.start - t0) * sp, (t.end - t0) * sp
            waited = min(q[i], e - s) if i < len(q) else 0.0
            queue.append((s, s + waited))
            llm.append((s + waited, e))
        rows.append({"id": r.id, "start": (r.start - t0) * sp, "end": (r.end - t0) * sp,
                     "queue": queue, "llm": llm})
    return rows


def _pctl(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


PoolFactory = Callable[[Sequence[int], LiveScenario],
                      contextlib.AbstractAsyncContextManager[list[str]]]


async def run_pass(name: str, sc: LiveScenario, specs: list[TrajectorySpec],
                   lb: float, workdir: Path, pool: PoolFactory = pool_for) -> LivePass:
    """One policy over the batch; ``pool(layout, sc)`` yields the backends (``URL#tp=N``)."""
    policy = get_policy(name, seed=sc.seed)
    layout = list(policy.initial_layout(sc.gpus))
    async with pool(layout, sc) as backends, httpx.AsyncClient(timeout=60) as http:
        settings = Settings(
            database_url=sc.database_url or f"sqlite+aiosqlite:///{workdir / f'{name}.db'}",
            backends=backends, policy=name,
            server=ServerSettings(host="127.0.0.1", port=free_port()),
            dispatch=DispatchSettings(cap_per_gpu=sc.cap_per_gpu,
                                      speed_profile=f"{sc.model}/{sc.gpu}",
                                      tick_s=max(0.05, 0.5 / sc.speed)),
            traces={"spool_path": workdir / f"{name}.spool"})
        urls = [b.split("#")[0] for b in backends]
        async with serve_gateway(settings) as gw:
            samples: list[tuple[int, int]] = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample_engines(http, urls, samples, stop))
            batch = await run_batch(specs, HarnessConfig(
                gw, sc.model, speed=sc.speed, seed=sc.seed, stream=False,
                reward_latency=False))
            stop.set()
            await sampler
            hit_rate, lag = await _engine_totals(http, urls)
            queues = await _queues(http, gw, [s.id for s in specs], sc.speed)
            pol = (await http.get(f"{gw}/admin/policy")).json()
    return _summarize(name, policy.label or name, layout, batch, lb, queues, hit_rate, lag,
                      samples, pol)


def _summarize(name: str, label: str, layout: list[int], batch: BatchResult, lb: float,
               queues: Mapping[str, list[float]], hit_rate: float, lag: float,
               samples: list[tuple[int, int]], pol: Mapping[str, Any]) -> LivePass:
    durations = sorted(r.duration * batch.speed for r in batch.trajectories)
    queue = [q for qs in queues.values() for q in qs]
    idle = sum(i for i, _ in samples) / max(1, sum(n for _, n in samples))
    return LivePass(
        name, label, layout, batch.makespan_s, batch.output_tokens / batch.makespan_s,
        statistics.median(durations), _pctl(durations, 0.99), lb, int(pol["migrations"]), 0,
        int(pol["relayouts"]), statistics.fmean(queue) if queue else 0.0, _pctl(queue, 0.99),
        hit_rate, idle, lag, batch.errors, trajectories=_timeline(batch, queues))


def simulate(name: str, sc: LiveScenario, specs: list[TrajectorySpec]) -> float:
    """The discrete-event reference: same batch, layout and cap; layout changes ignored."""
    profs = profiles(sc.model, sc.gpu, None, max(t for t in (1, 2, 4, 8) if t <= sc.gpus))
    policy = FixedLayout(get_policy(name, seed=sc.seed))
    cfg = SimConfig(sc.gpus, profs, speeds(profs), cap_per_gpu=sc.cap_per_gpu, seed=sc.seed)
    return Simulator(specs, policy, cfg).run()


async def run_live(sc: LiveScenario, names: Sequence[str],
                   on_pass: Any = None) -> tuple[list[TrajectorySpec], float, list[LivePass]]:
    specs = generate(sc.workload, sc.seed, prompts=sc.prompts, group_size=sc.group_size,
                     max_context=sc.max_context)
    profs = profiles(sc.model, sc.gpu, None, max(t for t in (1, 2, 4, 8) if t <= sc.gpus))
    lb = lower_bound(specs, profs, sc.gpus)
    workdir = Path(tempfile.mkdtemp(prefix="rollout-gateway-live-"))
    passes = []
    for name in names:
        started = time.perf_counter()
        p = await run_pass(name, sc, specs, lb, workdir)
        p.sim_makespan_s = simulate(name, sc, specs)
        p.live_vs_sim_diff = (p.makespan_s - p.sim_makespan_s) / p.sim_makespan_s
        passes.append(p)
        if on_pass is not None:
            on_pass(p, time.perf_counter() - started)
    return specs, lb, passes


def as_json(sc: LiveScenario, specs: list[TrajectorySpec], lb: float,
            passes: list[LivePass]) -> dict[str, Any]:
    return {"scenario": asdict(sc), "trajectories": len(specs), "lower_bound_makespan_s": lb,
            "results": {p.policy: {k: v for k, v in asdict(p).items() if k != "trajectories"}
                        for p in passes}}
