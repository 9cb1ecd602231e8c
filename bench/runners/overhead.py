"""``rollout-gateway bench overhead``: what the gateway adds to a call, against LiteLLM.

One fast upstream (``bench/harness/fast_upstream.py``, answers at once, streaming and not), three
ways to reach it, measured one after the other in the same run by the same load
generator (``bench/harness/loadgen.py``, its own process): ``direct``, through ``gateway``
(``python -m gateway serve``: uvloop + httptools, traces ON into Postgres, the default
policy) and through ``litellm`` (its proxy, one worker, request logging to a file; from
its own throwaway virtualenv). Per target: a max-rate search (open loop, rates stepped up
until the run is no longer sustained), then fixed open-loop rates. Added latency =
target percentile - direct percentile at the same offered rate.

Core placement (``--server-cpus``, ``--side-cpus``): the server under test alone on one
core, upstream + load generator on the other; Postgres is not pinned.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import litellm_env, procs

SUSTAIN_P99_MS = 50.0  # an open-loop step is sustained if p99 stays under this ...
SUSTAIN_FRACTION = 0.97  # ... and this fraction of the offered calls is answered, no errors


@dataclass
class OverheadOptions:
    rates: list[float] = field(default_factory=lambda: [100.0, 250.0, 500.0])
    duration_s: float = 15.0
    search_step_s: float = 4.0
    search_steps: int = 7
    targets: list[str] = field(default_factory=lambda: ["direct", "plain", "gateway",
                                                         "litellm"])
    server_cpus: str | None = "0"
    side_cpus: str | None = "1"
    pg_admin: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    max_tokens: int = 16
    streamed: str = "alternate"  # or "all", "none" (bench.harness.loadgen --streamed)
    litellm_venv: Path = litellm_env.DEFAULT_VENV
    out: Path = Path("artifacts/bench/overhead")


Progress = Callable[[str], None]


def loadgen(url: str, opts: OverheadOptions, headers: list[str], *, rate: float = 0,
            concurrency: int = 32, duration: float, warmup: float = 1.0) -> dict[str, Any]:
    cmd = [procs.PY, "-m", "bench.harness.loadgen", "--url", url, "--duration", str(duration),
           "--warmup", str(warmup), "--max-tokens", str(opts.max_tokens),
           "--streamed", opts.streamed]
    cmd += ["--rate", str(rate)] if rate else ["--concurrency", str(concurrency)]
    for h in headers:
        cmd += ["--header", h]
    res = subprocess.run(procs.pinned(cmd, opts.side_cpus), capture_output=True, text=True,
                         timeout=duration + warmup + 120, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"load generator failed: {res.stderr[-1500:]}")
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def sustained(step: dict[str, Any]) -> bool:
    p99 = step["all"]["p99_ms"]
    return (step["errors"] == 0 and p99 is not None and p99 <= SUSTAIN_P99_MS
            and step["ok"] >= SUSTAIN_FRACTION * step["offered_rps"] * step["duration_s"])


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of ``pid``'s whole process group (a server with several worker
    processes, such as LiteLLM's, counts all of them), children already reaped included."""
    if pid is None:
        return 0.0
    try:
        group = os.getpgid(pid)
    except OSError:
        return 0.0
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # fields: state ppid pgrp ... utime(11) stime(12)
            ticks += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


class Target:
    """One way to reach the upstream: its URL, headers and server process (if any)."""

    def __init__(self, name: str, url: str, headers: list[str], pid: int | None) -> None:
        self.name, self.url, self.headers, self.pid = name, url, headers, pid

    def step(self, opts: OverheadOptions, *, rate: float = 0, duration: float,
             concurrency: int = 32) -> dict[str, Any]:
        before = cpu_seconds(self.pid)
        res = loadgen(self.url, opts, self.headers, rate=rate, concurrency=concurrency,
                      duration=duration)
        res["duration_s"] = duration
        used = cpu_seconds(self.pid) - before
        if self.pid is not None and res["ok"]:
            # includes the 1 s warm-up's calls: an estimate of server CPU per call
            res["server_cpu_ms_per_call"] = used * 1000 / (res["ok"] * (1 + 1 / duration))
        return res


def max_rate_search(t: Target, opts: OverheadOptions, say: Progress) -> dict[str, Any]:
    """Closed-loop saturation first; then open-loop steps bisecting (geometrically)
    between the highest sustained and the lowest unsustained rate, starting at 60% of
    saturation, until they are within 10%. The highest sustained rate is the maximum."""
    sat = t.step(opts, duration=opts.search_step_s)
    lo, hi = 0.0, max(20.0, sat["achieved_rps"] * 1.3)
    rate = max(10.0, sat["achieved_rps"] * 0.6)
    steps: list[dict[str, Any]] = []
    for _ in range(opts.search_steps):
        rate = round(rate, -1) if rate >= 100 else round(rate)
        say(f"{t.name}: max-rate search, {rate:.0f} req/s")
        step = t.step(opts, rate=rate, duration=opts.search_step_s)
        step["sustained"] = sustained(step)
        steps.append(step)
        if step["sustained"]:
            lo = rate
        else:
            hi = rate
        if lo and hi / lo < 1.1:
            break
        rate = (lo * hi) ** 0.5 if lo else rate / 2
    return {"saturation": sat, "steps": steps, "max_rate_rps": lo}


def measure(t: Target, opts: OverheadOptions, say: Progress) -> dict[str, Any]:
    t.step(opts, duration=2.0)  # warm connections and caches
    search = max_rate_search(t, opts, say)
    fixed: dict[str, Any] = {}
    for rate in opts.rates:
        if search["max_rate_rps"] and rate > 1.5 * search["max_rate_rps"]:
            fixed[str(int(rate))] = {"skipped": f"over 1.5x the max sustainable rate "
                                                f"({search['max_rate_rps']:.0f} req/s)"}
            continue
        say(f"{t.name}: {rate:.0f} req/s for {opts.duration_s:g} s")
        fixed[str(int(rate))] = t.step(opts, rate=rate, duration=opts.duration_s)
    return {"url": t.url, "max_rate": search, "fixed": fixed}


@contextlib.contextmanager
def postgres_db(admin_dsn: str, prefix: str) -> Iterator[str]:
    """A fresh database for this run (dropped afterwards); yields its asyncpg URL."""
    import asyncio

    import asyncpg

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_dsn, timeout=10)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    base = admin_dsn.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    try:
        yield f"{base}/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def count_calls(url: str) -> int:
    import asyncio

    import asyncpg

    async def q() -> int:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return int(await conn.fetchval("SELECT count(*) FROM calls"))
        finally:
            await conn.close()

    return asyncio.run(q())


@contextlib.contextmanager
def open_target(name: str, upstream: str, opts: OverheadOptions, work: Path,
                key: str) -> Iterator[tuple[Target, dict[str, Any]]]:
    info: dict[str, Any] = {}
    auth = [f"authorization: Bearer {key}"]
    if name == "direct":
        yield Target(name, upstream, auth, None), info
    elif name == "gateway":
        with postgres_db(opts.pg_admin, "rg_bench_overhead") as db_url:
            env = {"ROLLOUT_GATEWAY_DISPATCH__CAP_PER_GPU": "4096",
                   "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH": str(work / "spool.jsonl")}
            with procs.gateway(upstream, db_url, opts.server_cpus, env=env,
                               log=work / "gateway.log") as url:
                pid = server_pid(url)
                yield Target(name, url, auth, pid), info
                time.sleep(1.0)  # the writer flushes every 0.25 s
                info["calls_recorded"] = count_calls(db_url)
    elif name == "plain":
        with procs.plain_proxy(upstream, opts.server_cpus, log=work / "plain.log") as url:
            yield Target(name, url, auth, server_pid(url)), info
    elif name == "litellm":
        _, took = litellm_env.ensure_venv(opts.litellm_venv)
        info["venv_setup_s"] = took
        info["version"] = litellm_env.version(opts.litellm_venv)
        info["workers"] = litellm_env.cpus_in(opts.server_cpus)
        info["published"] = litellm_env.PUBLISHED
        with litellm_env.litellm_proxy(upstream, work / "litellm", opts.server_cpus, key,
                                       opts.litellm_venv) as url:
            info["health_before"] = litellm_env.readiness(url, key)
            yield Target(name, url, auth, server_pid(url)), info
            info["health_after"] = litellm_env.readiness(url, key)
            log = work / "litellm" / "litellm-requests.jsonl"
            info["calls_logged"] = sum(1 for _ in log.open()) if log.exists() else 0
        info["server_log_errors"] = litellm_env.log_errors(work / "litellm" / "litellm.log")
    else:
        raise ValueError(f"unknown target {name!r}: direct, plain, gateway or litellm")


def server_pid(url: str) -> int | None:
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True,
                         check=False).stdout
    marker = "pid="
    if marker not in out:
        return None
    return int(out.split(marker, 1)[1].split(",", 1)[0])


def added(results: dict[str, Any], name: str) -> dict[str, Any]:
    """Per fixed rate: target percentile minus direct percentile (ms), per request kind."""
    out: dict[str, Any] = {}
    direct, mine = results["direct"]["fixed"], results[name]["fixed"]
    for rate, step in mine.items():
        base = direct.get(rate, {})
        if "skipped" in step or "skipped" in base or not base:
            out[rate] = None
            continue
        out[rate] = {kind: {p: _sub(step[kind][p], base[kind][p]) for p in ("p50_ms", "p99_ms")}
                     for kind in ("all", "non_stream", "stream")}
    return out


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "platform": platform.platform(), "load_avg_at_start": list(load)}


def run_overhead(opts: OverheadOptions, say: Progress, command: str) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    key = "sk-bench-" + secrets.token_hex(16)
    doc: dict[str, Any] = {"command": command, "machine": machine(),
                           "placement": {"server_cpus": opts.server_cpus,
                                         "side_cpus": opts.side_cpus},
                           "options": {"rates": opts.rates, "duration_s": opts.duration_s,
                                       "search_step_s": opts.search_step_s,
                                       "max_tokens": opts.max_tokens,
                                       "sustained_if": {"p99_ms_max": SUSTAIN_P99_MS,
                                                        "answered_min": SUSTAIN_FRACTION}},
                           "results": {}, "info": {}}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp, \
            procs.fast_upstream(opts.side_cpus, Path(tmp) / "upstream.log") as upstream:
        for name in opts.targets:
            with open_target(name, upstream, opts, Path(tmp), key) as (target, info):
                doc["results"][name] = measure(target, opts, say)
            doc["info"][name] = info
    doc["wall_s"] = time.time() - started
    doc["summary"] = summarize(doc)
    return doc


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    res = doc["results"]
    out: dict[str, Any] = {"max_rate_rps": {k: v["max_rate"]["max_rate_rps"]
                                            for k, v in res.items()},
                           "saturation_rps": {k: v["max_rate"]["saturation"]["achieved_rps"]
                                              for k, v in res.items()}}
    if "direct" in res:
        out["added_latency_ms"] = {k: added(res, k) for k in res if k != "direct"}
    mr = out["max_rate_rps"]
    if mr.get("gateway") and mr.get("litellm"):
        out["max_rate_ratio_gateway_over_litellm"] = mr["gateway"] / mr["litellm"]
        sat = out["saturation_rps"]
        out["saturation_ratio_gateway_over_litellm"] = sat["gateway"] / sat["litellm"]
    if "plain" in res and "gateway" in res:
        out["gateway_over_plain_ms"] = _minus(res["gateway"]["fixed"], res["plain"]["fixed"])
    lite = doc.get("info", {}).get("litellm")
    if "litellm" in res and lite:
        out["litellm_per_core"] = per_core(res["litellm"]["max_rate"]["saturation"], lite)
    out["targets"] = targets_status(out)
    return out


def _minus(mine: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Per fixed rate: ``mine`` percentile minus ``base`` percentile (ms), all calls."""
    out: dict[str, Any] = {}
    for rate, step in mine.items():
        other = base.get(rate, {})
        if "skipped" in step or "skipped" in other or not other:
            out[rate] = None
            continue
        out[rate] = {p: _sub(step["all"][p], other["all"][p]) for p in ("p50_ms", "p99_ms")}
    return out


def per_core(saturation: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """LiteLLM's closed-loop saturation per worker core here, next to the per-vCPU rate
    its own published benchmark implies (a like-for-like check of the configuration)."""
    pub = info["published"]
    here = saturation["achieved_rps"] / max(1, info.get("workers", 1))
    published = pub["rps"] / pub["vcpus"]
    return {"saturation_rps_per_core": here, "published_rps_per_vcpu": published,
            "ratio_to_published": here / published,
            "saturation_p50_ms": saturation["all"]["p50_ms"],
            "saturation_p99_ms": saturation["all"]["p99_ms"],
            "published_p50_ms": pub["p50_ms"], "published_p99_ms": pub["p99_ms"],
            "source": pub["source"]}


def targets_status(s: dict[str, Any]) -> dict[str, Any]:
    gw = (s.get("added_latency_ms") or {}).get("gateway", {}).get("500")
    p50 = gw["all"]["p50_ms"] if gw else None
    p99 = gw["all"]["p99_ms"] if gw else None
    ratio = s.get("max_rate_ratio_gateway_over_litellm")
    return {
        "p50_added_at_500_le_1ms": {"value": p50, "met": p50 is not None and p50 <= 1.0},
        "p99_added_at_500_le_5ms": {"value": p99, "met": p99 is not None and p99 <= 5.0},
        "max_rate_ge_3x_litellm": {"value": ratio, "met": ratio is not None and ratio >= 3.0},
    }
