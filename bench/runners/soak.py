"""The soak: a gateway process under a steady agentic load for minutes, watched for leaks.

``rollout-gateway bench soak`` (and the ``soak``-marked test) start a simulated pool and
the gateway as child processes, then keep ``concurrency`` agent loops busy: each runs
one trajectory of a few turns (streamed and not, with short tool gaps), reports its
reward, and starts the next. It samples the gateway's resident memory and open file
descriptors, and at the end checks that every counter returned to zero: calls in flight
(admission, per backend), queued or generating trajectories, and the gateway's asyncio
tasks back to their idle number.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.harness.hosting import free_port, sim_pool_process

MODEL = "qwen3-14b"
FD_SLACK = 8  # descriptors that may legitimately come and go (health checks, SQLite)


@dataclass
class SoakConfig:
    duration_s: float = 600.0
    warmup_s: float = 60.0
    concurrency: int = 200
    instances: int = 4
    speed: float = 20.0
    sample_every_s: float = 5.0
    settle_s: float = 5.0  # wait this long for descriptors to come back to idle
    seed: int = 0


@dataclass
class SoakResult:
    config: dict[str, float]
    calls_ok: int = 0
    calls_failed: int = 0
    trajectories: int = 0
    rss_mb_idle: float = 0.0
    rss_mb_after_warmup: float = 0.0
    rss_mb_end: float = 0.0
    rss_growth_pct: float = 0.0
    fds_idle: int = 0
    fds_end_idle: int = 0
    tasks_idle: float = 0.0
    tasks_end_idle: float = 0.0
    in_flight_end: float = 0.0
    backend_in_flight_end: float = 0.0
    live_trajectories_end: float = 0.0
    trace_dropped: float = 0.0
    samples: list[tuple[float, float, int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def check(self) -> list[str]:
        """What is wrong (empty when the soak passed)."""
        bad = []
        if self.calls_failed:
            bad.append(f"{self.calls_failed} calls failed: {self.failures[:3]}")
        if self.rss_growth_pct >= 10:
            bad.append(f"resident memory grew {self.rss_growth_pct:.1f}% after warm-up")
        if self.in_flight_end or self.backend_in_flight_end or self.live_trajectories_end:
            bad.append("counters did not return to zero")
        if self.tasks_end_idle > self.tasks_idle:
            bad.append(f"asyncio tasks {self.tasks_idle:g} -> {self.tasks_end_idle:g}")
        # idle keep-alive connections to backends (at most one per concurrent call) may
        # stay pooled; anything beyond that is a leak
        if self.fds_end_idle > self.fds_idle + self.config["concurrency"] + FD_SLACK:
            bad.append(f"file descriptors {self.fds_idle} -> {self.fds_end_idle}")
        if self.trace_dropped:
            bad.append(f"{self.trace_dropped:g} trace records dropped")
        return bad


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value) if "{" in name else float(value)
    return out


def _sum(metrics: dict[str, float], prefix: str, where: str = "") -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix) and where in k)


def _spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)


@contextlib.asynccontextmanager
async def _gateway(backends: list[str], workdir: Path) -> AsyncIterator[tuple[str, int]]:
    port = free_port()
    args = [sys.executable, "-m", "gateway", "serve", "--port", str(port),
            "--database-url", f"sqlite+aiosqlite:///{workdir / 'soak.db'}",
            "--log-level", "warning"]
    for b in backends:
        args += ["--backend", b]
    env = {**os.environ, "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH": str(workdir / "spool.jsonl"),
           "ROLLOUT_GATEWAY_SERVER__SHUTDOWN_DELAY_S": "0"}
    proc = _spawn(args, env, workdir / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=1) as http:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                if proc.poll() is not None:
                    raise RuntimeError((workdir / "gateway.log").read_text()[-2000:])
                await asyncio.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 60)


async def _agent(http: httpx.AsyncClient, url: str, worker: int, stop: asyncio.Event,
                 res: SoakResult, speed: float, seed: int) -> None:
    rng = random.Random(f"{seed}:{worker}")
    n = 0
    while not stop.is_set():
        n += 1
        tid, group = f"soak-{worker}-{n}", f"g{worker % 25}"
        base = f"{url}/g/{group}/t/{tid}/v1/chat/completions"
        messages = [{"role": "user", "content": f"task {worker % 25}: fix the failing test"}]
        for turn in range(rng.randint(2, 6)):
            body = {"model": MODEL, "messages": messages, "max_tokens": rng.randint(20, 200),
                    "ignore_eos": True, "stream": turn % 2 == 0}
            try:
                r = await http.post(base, json=body)
                ok = r.status_code == 200 and (not body["stream"] or "[DONE]" in r.text)
            except httpx.HTTPError as exc:
                ok, r = False, None
                res.failures.append(f"{tid}: {type(exc).__name__}")
            if not ok:
                res.calls_failed += 1
                if r is not None:
                    res.failures.append(f"{tid}: {r.status_code} {r.text[:200]}")
                break
            res.calls_ok += 1
            messages += [{"role": "assistant", "content": "ok " * 20},
                         {"role": "tool", "content": "output " * rng.randint(10, 300)}]
            await asyncio.sleep(rng.uniform(0.1, 3.0) / speed)
        try:
            await http.post(f"{url}/trajectories/{tid}/finish", json={"reward": 1.0})
        except httpx.HTTPError as exc:
            res.calls_failed += 1
            res.failures.append(f"{tid} finish: {type(exc).__name__}")
        res.trajectories += 1


async def _quiet(http: httpx.AsyncClient, url: str, pid: int) -> dict[str, float]:
    """Metrics once the gateway has settled after the load (counters at rest)."""
    m: dict[str, float] = {}
    for _ in range(100):
        m = _metrics((await http.get(f"{url}/metrics")).text)
        if not m.get("rollout_gateway_calls_in_flight", 1):
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    return _metrics((await http.get(f"{url}/metrics")).text)


async def run_soak(cfg: SoakConfig, progress: bool = False) -> SoakResult:
    res = SoakResult(config={k: float(v) for k, v in asdict(cfg).items()})
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        async with sim_pool_process(count=cfg.instances, model=MODEL, gpu="H100",
                                    speed=cfg.speed) as urls, \
                _gateway(urls, Path(tmp)) as (url, pid):
            limits = httpx.Limits(max_connections=cfg.concurrency + 8,
                                  max_keepalive_connections=cfg.concurrency + 8)
            async with httpx.AsyncClient(timeout=120, limits=limits) as http:
                idle = _metrics((await http.get(f"{url}/metrics")).text)
                res.tasks_idle = idle["rollout_gateway_asyncio_tasks"]
                res.fds_idle, res.rss_mb_idle = _fds(pid), _rss_mb(pid)
                stop = asyncio.Event()
                agents = [asyncio.create_task(
                    _agent(http, url, i, stop, res, cfg.speed, cfg.seed))
                    for i in range(cfg.concurrency)]
                start = time.monotonic()
                while (elapsed := time.monotonic() - start) < cfg.duration_s:
                    await asyncio.sleep(cfg.sample_every_s)
                    elapsed = time.monotonic() - start
                    res.samples.append((round(elapsed, 1), round(_rss_mb(pid), 1), _fds(pid)))
                    if progress:
                        print(f"{elapsed:6.0f}s rss={res.samples[-1][1]:.0f}MB "
                              f"fds={res.samples[-1][2]} calls={res.calls_ok} "
                              f"failed={res.calls_failed}", flush=True)
                stop.set()
                await asyncio.gather(*agents)
            # the harness's connections are closed; the gateway's idle upstream ones
            # expire after aiohttp's 60 s keep-alive
            async with httpx.AsyncClient(timeout=10) as http:
                end = await _quiet(http, url, pid)
                res.tasks_end_idle = end["rollout_gateway_asyncio_tasks"]
                res.in_flight_end = end["rollout_gateway_calls_in_flight"]
                res.backend_in_flight_end = _sum(end, "rollout_gateway_backend_in_flight")
                res.live_trajectories_end = sum(
                    _sum(end, "rollout_gateway_trajectories", f'phase="{p}"')
                    for p in ("queued", "generating"))
                res.trace_dropped = end.get("rollout_gateway_trace_dropped", 0.0)
            for _ in range(int(cfg.settle_s)):
                if _fds(pid) <= res.fds_idle + FD_SLACK:
                    break
                await asyncio.sleep(1)
            res.fds_end_idle = _fds(pid)
    _memory(res, cfg)
    return res


def _memory(res: SoakResult, cfg: SoakConfig) -> None:
    """Median RSS over the first minute after warm-up vs over the last minute."""
    window = 60.0
    early = [r for t, r, _ in res.samples if cfg.warmup_s <= t < cfg.warmup_s + window]
    late = [r for t, r, _ in res.samples if t >= cfg.duration_s - window]
    if not early or not late:
        early = late = [r for _, r, _ in res.samples[-1:]] or [0.0]
    res.rss_mb_after_warmup = statistics.median(early)
    res.rss_mb_end = statistics.median(late)
    res.rss_growth_pct = 100 * (res.rss_mb_end - res.rss_mb_after_warmup) / max(
        res.rss_mb_after_warmup, 1e-9)


def soak_command(
    minutes: float = 10.0, concurrency: int = 200, instances: int = 4, speed: float = 20.0,
    warmup_minutes: float = 1.0, json_out: Path | None = None,
) -> None:
    """Soak the gateway: steady agentic load; memory, tasks, connections, counters."""
    import typer

    cfg = SoakConfig(duration_s=minutes * 60, warmup_s=warmup_minutes * 60,
                     concurrency=concurrency, instances=instances, speed=speed)
    res = asyncio.run(run_soak(cfg, progress=True))
    summary = {k: v for k, v in asdict(res).items() if k not in ("samples", "failures")}
    print(json.dumps(summary, indent=2))
    if json_out is not None:
        json_out.write_text(json.dumps(asdict(res), indent=2))
    problems = res.check()
    for p in problems:
        print("FAIL:", p)
    if problems:
        raise typer.Exit(1)
    print("soak passed")
