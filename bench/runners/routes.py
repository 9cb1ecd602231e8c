"""``rollout-gateway bench routes``: what recording routed experts adds to a call.

One simulated engine with routes on (``sim-backend --enable-return-routed-experts
ROUTER``) and one without, each in its own process, and the gateway (``python -m gateway
serve``, traces into Postgres) on its own core. The same swe-like trajectories (a 1,500-
token system prompt and task, then tool observations of LN(400, 1.1) tokens, every turn
200 generated tokens) run through the gateway in five modes, alternated ``repeats``
times:

- ``dense``: the engine without routes (the baseline);
- ``routes``: routes on, asked from the first position the record lacks (the default);
- ``routes-from-0``: routes on, every call asking from position 0
  (``capture.routes_new_only`` off): what asking only new positions saves;
- ``dense-stream`` and ``routes-stream``: the same streamed, where the gateway asks the
  engine for each call's routes once the stream's tokens are out.

Per mode: the client's latency per call (median, p90), the gateway's CPU per call
(user + system of its process), and the route positions the engine returned per call.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.harness import procs
from bench.harness.hosting import free_port
from bench.runners.overhead import cpu_seconds, machine, postgres_db, server_pid
from bench.runners.store import SYSTEM_TOKENS, TASK_TOKENS, observation_sizes, words_text

Progress = Callable[[str], None]
MODEL = "qwen3-14b"
COMPLETION = 200
MODES = ("dense", "routes", "routes-from-0", "dense-stream", "routes-stream")


@dataclass
class RoutesOptions:
    router: str = "qwen3-30b-a3b"
    trajectories: int = 8
    turns: int = 10
    concurrency: int = 4
    repeats: int = 2
    speed: float = 100.0
    server_cpus: str | None = "0"
    side_cpus: str | None = "1"
    pg_admin: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    seed: int = 1
    out: Path = Path("artifacts/bench/routes")


@contextmanager
def sim_engine(opts: RoutesOptions, routes: bool, log: Path) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [procs.PY, "-m", "gateway", "sim-backend", "--port", str(port), "--model", MODEL,
           "--speed", str(opts.speed), "--scheduling-policy", "fcfs"]
    if routes:
        cmd += ["--enable-return-routed-experts", opts.router]
    with procs.process(cmd, ready_url=f"{url}/health", cpus=opts.side_cpus, log=log):
        yield url


async def _trajectory(session: Any, url: str, tid: str, opts: RoutesOptions, seed: int,
                      stream: bool, latencies: list[float]) -> None:
    rng = np.random.default_rng(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words_text(SYSTEM_TOKENS, seed)},
        {"role": "user", "content": words_text(TASK_TOKENS, seed + 1)}]
    headers = {"content-type": "application/json", "x-trajectory-id": tid}
    for turn, obs in enumerate(observation_sizes(rng, opts.turns)):
        body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": COMPLETION,
                             "ignore_eos": True, "stream": stream})
        started = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", data=body,
                                headers=headers) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"gateway answered {resp.status}: {data[:300]!r}")
        latencies.append(time.perf_counter() - started)
        if stream:
            text = "".join(
                (orjson.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content")
                or "" for line in data.decode().splitlines()
                if line.startswith("data: {"))
        else:
            text = orjson.loads(data)["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": words_text(obs, seed * 100 + turn)}]


async def _drive(url: str, opts: RoutesOptions, stream: bool, tag: str) -> list[float]:
    import aiohttp

    latencies: list[float] = []
    sem = asyncio.Semaphore(opts.concurrency)

    async def one(i: int) -> None:
        async with sem:
            await _trajectory(session, url, f"{tag}-{i}", opts, opts.seed + i, stream,
                              latencies)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(i) for i in range(opts.trajectories)))
    return latencies


def _positions(engine: str, before: int) -> tuple[int, int]:
    """Requests the engine saw since its ``before``-th, and the route positions it returned
    (non-streamed answers only: streams carry none)."""
    import httpx

    seen = httpx.get(f"{engine}/sim/stats", timeout=30).json()["requests_seen"][before:]
    return len(seen), sum(
        max(0, r["prompt_tokens"] + r["max_tokens"] - 1
            - (r["routed_experts_prompt_start"] or 0))
        for r in seen if not r["stream"])


def _seen_count(engine: str) -> int:
    import httpx

    return len(httpx.get(f"{engine}/sim/stats", timeout=30).json()["requests_seen"])


def one_run(mode: str, engine: str, opts: RoutesOptions, work: Path, run: int,
            say: Progress) -> dict[str, Any]:
    stream = mode.endswith("-stream")
    env = {"ROLLOUT_GATEWAY_CAPTURE__ROUTES_NEW_ONLY": "false"} \
        if mode == "routes-from-0" else {}
    before = _seen_count(engine)
    with postgres_db(opts.pg_admin, "rg_bench_routes") as db, \
            procs.gateway(engine, db, opts.server_cpus, env=env,
                          log=work / f"gateway-{mode}-{run}.log") as gw:
        pid = server_pid(gw)
        cpu0 = cpu_seconds(pid)
        say(f"run {run + 1}/{opts.repeats}: {mode}")
        started = time.perf_counter()
        lat = asyncio.run(_drive(gw, opts, stream, f"{mode}-{run}"))
        wall = time.perf_counter() - started
        cpu = cpu_seconds(pid) - cpu0
    requests, positions = _positions(engine, before)
    calls = len(lat)
    return {"mode": mode, "run": run, "calls": calls, "wall_s": wall,
            "latency_ms_p50": 1000 * statistics.median(lat),
            "latency_ms_p90": 1000 * float(np.percentile(lat, 90)),
            "gateway_cpu_ms_per_call": 1000 * cpu / calls,
            "engine_requests_per_call": requests / calls,
            "route_positions_per_call": positions / calls if mode.startswith("routes") else 0.0}


def run_routes(opts: RoutesOptions, say: Progress, command: str) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    work = opts.out / "logs"
    work.mkdir(exist_ok=True)
    doc: dict[str, Any] = {"command": command, "machine": machine(), "router": opts.router,
                           "shape": {"system_and_task_tokens": SYSTEM_TOKENS + TASK_TOKENS,
                                     "observation_tokens": "LN(400, 1.1) cap 6000",
                                     "completion_tokens": COMPLETION, "turns": opts.turns,
                                     "trajectories": opts.trajectories,
                                     "concurrency": opts.concurrency,
                                     "engine_speed": opts.speed}}
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        dense = stack.enter_context(sim_engine(opts, False, work / "dense.log"))
        routed = stack.enter_context(sim_engine(opts, True, work / "routes.log"))
        for run in range(opts.repeats):
            for mode in MODES:
                engine = routed if mode.startswith("routes") else dense
                runs.append(one_run(mode, engine, opts, work, run, say))
    doc["runs"] = runs
    doc["summary"] = summarize(runs)
    return doc


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode, the mean over runs; and each routes mode against its dense baseline run
    by run (the runs alternate, so run ``i`` of both shared the machine's state)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {k: statistics.fmean(r[k] for r in mine)
                     for k in ("latency_ms_p50", "latency_ms_p90", "gateway_cpu_ms_per_call",
                               "engine_requests_per_call", "route_positions_per_call")}
    for mode, base in (("routes", "dense"), ("routes-from-0", "dense"),
                       ("routes-stream", "dense-stream")):
        pairs = list(zip([r for r in runs if r["mode"] == mode],
                         [r for r in runs if r["mode"] == base], strict=True))
        out[mode]["added_latency_ms_p50"] = [a["latency_ms_p50"] - b["latency_ms_p50"]
                                             for a, b in pairs]
        out[mode]["added_cpu_ms_per_call"] = [
            a["gateway_cpu_ms_per_call"] - b["gateway_cpu_ms_per_call"] for a, b in pairs]
    return out


def routes_markdown(doc: dict[str, Any]) -> str:
    m, sh = doc["machine"], doc["shape"]
    lines = ["Command:", "", "```", doc["command"], "```", "",
             f"Machine: {m['cpu']}, {m['cores']} cores. Router {doc['router']}; "
             f"{sh['trajectories']} trajectories x {sh['turns']} turns, "
             f"{sh['concurrency']} at once; {sh['system_and_task_tokens']} tokens of system "
             f"prompt and task, observations {sh['observation_tokens']}, "
             f"{sh['completion_tokens']} generated tokens per turn; engine speed "
             f"x{sh['engine_speed']}.", "",
             "| mode | latency p50 (ms) | p90 | gateway CPU per call (ms) | engine requests "
             "per call | route positions per call | added p50 vs dense (ms, per run) | "
             "added CPU (ms, per run) |", "|---|---|---|---|---|---|---|---|"]
    for mode, s in doc["summary"].items():
        added = ", ".join(f"{x:+.1f}" for x in s.get("added_latency_ms_p50", []))
        cpu = ", ".join(f"{x:+.2f}" for x in s.get("added_cpu_ms_per_call", []))
        lines.append(f"| {mode} | {s['latency_ms_p50']:.1f} | {s['latency_ms_p90']:.1f} | "
                     f"{s['gateway_cpu_ms_per_call']:.2f} | "
                     f"{s['engine_requests_per_call']:.2f} | "
                     f"{s['route_positions_per_call']:.0f} | {added or '-'} | {cpu or '-'} |")
    return "\n".join(lines) + "\n"
