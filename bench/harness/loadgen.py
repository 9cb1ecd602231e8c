"""The overhead benchmark's load generator, run in its own process.

Open loop (``--rate``): request ``i`` is sent at ``t0 + i / rate`` whether or not the
earlier ones have answered, so a slow target cannot slow the offered load down (no
coordinated omission); latency runs from the actual send to the last byte of the body
(the whole SSE stream for streamed calls), and ``lag_p99_ms`` says how late sends left
against their schedule (the generator's own health). Closed loop (``--concurrency``):
that many workers back to back, for a saturation throughput. Even requests are
non-streamed, odd ones streamed (``--streamed all`` or ``none``: every one). Prints one
JSON object on stdout.

``python -m bench.harness.loadgen --url URL --rate 500 --duration 10``
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import orjson

SYSTEM = ("you are a careful software engineer who fixes failing tests in a python "
          "repository using the tools you are given and explains each step briefly")


def request_body(i: int, stream: bool, max_tokens: int) -> bytes:
    return orjson.dumps({
        "model": "bench", "stream": stream, "max_tokens": max_tokens, "temperature": 1.0,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"task {i % 97}: make the test suite pass"}],
    })


@dataclass
class Samples:
    sent: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    stream: list[bool] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class Client:
    def __init__(self, url: str, max_tokens: int, headers: dict[str, str],
                 streamed: str = "alternate") -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.max_tokens = max_tokens
        self.streamed = streamed
        self.headers = {"content-type": "application/json", **headers}
        # below uvicorn's 5 s keep-alive (the direct target): no request races its close
        conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4)
        self.session = aiohttp.ClientSession(connector=conn,
                                             timeout=aiohttp.ClientTimeout(total=30))

    async def call(self, i: int, out: Samples, record: bool, lag: float = 0.0) -> None:
        stream = i % 2 == 1 if self.streamed == "alternate" else self.streamed == "all"
        headers = {**self.headers, "x-trajectory-id": f"ov-{i // 8}"}
        t = time.perf_counter()
        try:
            async with self.session.post(self.url, data=request_body(i, stream, self.max_tokens),
                                         headers=headers) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            if record:
                out.error(type(exc).__name__)
            return
        dt = time.perf_counter() - t
        if not record:
            return
        if status != 200:
            out.error(f"http {status}")
            return
        out.sent.append(t)
        out.latency.append(dt)
        out.stream.append(stream)
        out.lag.append(lag)


async def open_loop(client: Client, rate: float, duration: float, warmup: float) -> Samples:
    out, tasks = Samples(), set[asyncio.Task[None]]()
    t0 = time.perf_counter()
    total = int((duration + warmup) * rate)
    for i in range(total):
        target = t0 + i / rate
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = time.perf_counter() - target
        task = asyncio.create_task(client.call(i, out, i >= warmup * rate, lag))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    return out


async def closed_loop(client: Client, concurrency: int, duration: float,
                      warmup: float) -> Samples:
    out = Samples()
    start = time.perf_counter()
    counter = iter(range(10**9))

    async def worker() -> None:
        while (now := time.perf_counter()) < start + warmup + duration:
            await client.call(next(counter), out, now >= start + warmup)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None}
    arr = np.asarray(values) * 1000
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99),
            "max_ms": float(arr.max())}


def summarize(s: Samples, duration: float, offered: float | None) -> dict[str, Any]:
    window = (max(s.sent) - min(s.sent)) if len(s.sent) > 1 else duration
    lat = np.asarray(s.latency)
    streamed = np.asarray(s.stream, dtype=bool)
    return {
        "offered_rps": offered, "ok": len(s.latency), "errors": s.errors,
        "error_kinds": s.error_kinds,
        "achieved_rps": len(s.latency) / max(window, 1e-9) if offered is None
        else len(s.latency) / duration,
        "all": _pcts(s.latency),
        "non_stream": _pcts(lat[~streamed].tolist() if len(lat) else []),
        "stream": _pcts(lat[streamed].tolist() if len(lat) else []),
        "lag_p99_ms": float(np.percentile(np.asarray(s.lag) * 1000, 99)) if s.lag else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = dict(h.split(":", 1) for h in args.header)
    client = Client(args.url, args.max_tokens, {k.strip(): v.strip() for k, v in headers.items()},
                    args.streamed)
    try:
        if args.rate:
            s = await open_loop(client, args.rate, args.duration, args.warmup)
            return summarize(s, args.duration, args.rate)
        s = await closed_loop(client, args.concurrency, args.duration, args.warmup)
        return summarize(s, args.duration, None)
    finally:
        await client.session.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--rate", type=float, default=0.0, help="open loop, requests/s")
    ap.add_argument("--concurrency", type=int, default=32, help="closed loop workers")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--header", action="append", default=[], help="NAME: VALUE")
    ap.add_argument("--streamed", choices=["alternate", "all", "none"], default="alternate")
    args = ap.parse_args()
    import uvloop

    result = uvloop.run(run(args))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
