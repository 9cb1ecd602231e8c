"""``rollout-gateway bench live``: real rollouts through the gateway, one pass per policy.

Each pass starts a fresh gateway in this process with that policy and a managed pool of
simulated vLLM servers (time compressed by ``speed``) laid out as the policy's initial
layout, and the emulated agent harness (official OpenAI client per trajectory) on the
same seeded batch. It reports what ``bench sim`` reports, plus what only a live run
shows: gateway-side queueing per turn, the engines' prefix-cache hit rate, and how idle
the GPUs were (sampled engine occupancy). The same batch then runs through the
discrete-event simulator under the same constraints, and the makespan difference
between the two says how far the simulator can be trusted.

Layout changes the policy proposes are applied live by the pool (drain, stop, a
simulated start-up of ``SIM_STARTUP_S``), and the simulator reference charges the same
restart cost; the report counts relayouts proposed and applied, their drain and start
seconds, and marks them in the Gantt. With ``static_pool`` (or a pool factory, e.g. real
vLLM on CPU) the servers run in child processes as a fixed pool: proposals are counted,
not applied, and the simulator ignores them too (``FixedLayout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness.batch import BatchResult, HarnessConfig, run_batch
from bench.harness.hosting import (
    SIM_STARTUP_S,
    free_port,
    pool_settings,
    serve_gateway,
    sim_pool_process,
    wait_routable,
)
from bench.simulator.des import SimConfig, Simulator
from bench.simulator.metrics import lower_bound
from bench.simulator.speeds import profiles, speeds
from bench.workloads import TrajectorySpec, generate
from gateway.config import DispatchSettings, ServerSettings, Settings
from gateway.policies.base import Policy, Relayout, Snapshot
from gateway.policies.registry import get_policy
from gateway.pool.monitor import EngineSample, parse_vllm_metrics


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
    static_pool: bool = False  # a fixed pool in child processes (relayouts not applied)


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
    relayout_drain_s: float = 0.0  # simulated seconds, summed over applied relayouts
    relayout_start_s: float = 0.0
    sim_reconfigurations: int = 0  # relayouts the simulator reference applied
    trajectories: list[dict[str, Any]] = field(default_factory=list)
    relayouts: list[dict[str, Any]] = field(default_factory=list)  # on the Gantt's axis


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


UrlSource = Callable[[], Awaitable[list[str]]]


def fixed_urls(urls: list[str]) -> UrlSource:
    async def get() -> list[str]:
        return urls
    return get


def pool_urls(http: httpx.AsyncClient, gw: str) -> UrlSource:
    """The backends registered now (a managed pool's instances come and go)."""
    async def get() -> list[str]:
        return [b["url"] for b in (await http.get(f"{gw}/status")).json()["backends"]]
    return get


async def _sample_engines(http: httpx.AsyncClient, urls: UrlSource,
                          samples: list[tuple[int, int]], seen: dict[str, EngineSample],
                          stop: asyncio.Event) -> None:
    """(idle instances, instances) every 0.2 s of real time, for the idle fraction; the
    last sample of every backend ever seen in ``seen`` (retired ones keep their counts)."""
    while not stop.is_set():
        current = await urls()
        engines = await _engines(http, current)
        seen.update(zip(current, engines, strict=True))
        samples.append((sum(1 for e in engines if not e.running and not e.waiting),
                        len(engines)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def _engine_totals(http: httpx.AsyncClient, urls: list[str],
                         seen: dict[str, EngineSample]) -> tuple[float, float]:
    """Prefix-cache hit rate over the pass (backends retired meanwhile count with their
    last sample), and the simulated pool's worst clock lag."""
    engines = {**seen, **dict(zip(urls, await _engines(http, urls), strict=True))}.values()
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


def _hosting(layout: Sequence[int], sc: LiveScenario, workdir: Path, name: str,
             pool: PoolFactory | None) -> contextlib.AbstractAsyncContextManager[dict[str, Any]]:
    """Settings fields for the pass's pool: a managed sim pool, or the backends a static
    pool factory starts."""
    static = (pool or pool_for)(layout, sc) if pool is not None or sc.static_pool else None
    return pool_settings(workdir / f"{name}.pool.json", layout, model=sc.model, gpu=sc.gpu,
                         speed=sc.speed, seed=sc.seed, static=static)


async def run_pass(name: str, sc: LiveScenario, specs: list[TrajectorySpec],
                   lb: float, workdir: Path, pool: PoolFactory | None = None) -> LivePass:
    """One policy over the batch on a managed sim pool, or on the fixed pool that
    ``pool(layout, sc)`` yields (``URL#tp=N``; default with ``static_pool``: child
    processes)."""
    policy = get_policy(name, seed=sc.seed)
    layout = list(policy.initial_layout(sc.gpus))
    async with _hosting(layout, sc, workdir, name, pool) as hosting, \
            httpx.AsyncClient(timeout=60) as http:
        settings = Settings(
            database_url=sc.database_url or f"sqlite+aiosqlite:///{workdir / f'{name}.db'}",
            policy=name, server=ServerSettings(host="127.0.0.1", port=free_port()),
            dispatch=DispatchSettings(cap_per_gpu=sc.cap_per_gpu,
                                      speed_profile=f"{sc.model}/{sc.gpu}",
                                      tick_s=max(0.05, 0.5 / sc.speed), time_scale=sc.speed),
            traces={"spool_path": workdir / f"{name}.spool"}, **hosting)
        async with serve_gateway(settings) as gw:
            await wait_routable(http, gw, len(layout))
            static = [b.split("#")[0] for b in hosting.get("backends", ())]
            urls = fixed_urls(static) if static else pool_urls(http, gw)
            samples: list[tuple[int, int]] = []
            seen: dict[str, EngineSample] = {}
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample_engines(http, urls, samples, seen, stop))
            batch = await run_batch(specs, HarnessConfig(
                gw, sc.model, speed=sc.speed, seed=sc.seed, stream=False,
                reward_latency=False))
            stop.set()
            await sampler
            hit_rate, lag = await _engine_totals(http, await urls(), seen)
            queues = await _queues(http, gw, [s.id for s in specs], sc.speed)
            pol = (await http.get(f"{gw}/admin/policy")).json()
            relayouts = (await http.get(f"{gw}/status")).json()["relayouts"]
    return _summarize(name, policy.label or name, layout, batch, lb, queues, hit_rate, lag,
                      samples, pol, relayouts)


def _relayout_spans(batch: BatchResult, relayouts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Applied (or running) relayouts in simulated seconds since the batch started."""
    sp = batch.speed
    t0 = batch.start + (time.time() - time.monotonic())  # the batch start on the epoch clock
    return [{"start": (r["started"] - t0) * sp,
             "end": (r["finished"] - t0) * sp if r["finished"] else None,
             "retire": r["retire"], "launch": r["launch"], "status": r["status"],
             "drain_s": r["drain_s"] * sp, "start_s": r["start_s"] * sp}
            for r in relayouts["recent"] if r["started"] is not None]


def _summarize(name: str, label: str, layout: list[int], batch: BatchResult, lb: float,
               queues: Mapping[str, list[float]], hit_rate: float, lag: float,
               samples: list[tuple[int, int]], pol: Mapping[str, Any],
               relayouts: Mapping[str, Any]) -> LivePass:
    durations = sorted(r.duration * batch.speed for r in batch.trajectories)
    queue = [q for qs in queues.values() for q in qs]
    idle = sum(i for i, _ in samples) / max(1, sum(n for _, n in samples))
    return LivePass(
        name, label, layout, batch.makespan_s, batch.output_tokens / batch.makespan_s,
        statistics.median(durations), _pctl(durations, 0.99), lb, int(pol["migrations"]),
        int(relayouts["applied"]), int(pol["relayouts"]),
        statistics.fmean(queue) if queue else 0.0, _pctl(queue, 0.99),
        hit_rate, idle, lag, batch.errors,
        relayout_drain_s=relayouts["drain_s"] * batch.speed,
        relayout_start_s=relayouts["start_s"] * batch.speed,
        trajectories=_timeline(batch, queues), relayouts=_relayout_spans(batch, relayouts))


def simulate(name: str, sc: LiveScenario, specs: list[TrajectorySpec]) -> tuple[float, int]:
    """The discrete-event reference: same batch, layout and cap; layout changes applied
    with the same restart cost as the live pool's start-up (ignored for a static pool).
    Returns the makespan and the relayouts it applied."""
    profs = profiles(sc.model, sc.gpu, None, max(t for t in (1, 2, 4, 8) if t <= sc.gpus))
    inner = get_policy(name, seed=sc.seed)
    policy: Any = FixedLayout(inner) if sc.static_pool else inner
    cfg = SimConfig(sc.gpus, profs, speeds(profs), cap_per_gpu=sc.cap_per_gpu, seed=sc.seed,
                    restart_s=SIM_STARTUP_S)
    sim = Simulator(specs, policy, cfg)
    return sim.run(), sim.stats.reconfigurations


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
        p.sim_makespan_s, p.sim_reconfigurations = simulate(name, sc, specs)
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
