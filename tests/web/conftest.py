"""Fixtures for the status page tests: a gateway over real (simulated) backends, and an
agent-like workload that keeps it busy while the page is watched."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway.app import create_app
from gateway.config import Settings, TraceSettings, UpstreamSettings
from tests.scripted_upstream import Script, Seen, make_upstream
from tests.servers import LoopThread, app_in_thread

ADMIN_TOKEN = "page-admin-token"
VLLM_METRICS = """# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="scripted"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="scripted"}} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="scripted"}} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="scripted"}} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="scripted"}} 300.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="scripted"}} {generated}
"""


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


def with_vllm_metrics(app: Any, seen: Seen) -> Callable[[Scope, Receive, Send], Any]:
    """Wrap a scripted upstream so that it also answers ``/metrics`` like vLLM does."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            body = VLLM_METRICS.format(running=len(seen.bodies) - seen.completed,
                                       generated=float(seen.completed * 5)).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return asgi


def gateway_settings(db_url: str, backends: list[str], *,
                     admin_token: str | None = ADMIN_TOKEN, **kw: Any) -> Settings:
    return Settings(database_url=db_url, backends=backends, admin_token=admin_token,
                    upstream=UpstreamSettings(health_interval_s=0.2),
                    traces=TraceSettings(flush_interval_s=0.05), **kw)


@pytest.fixture
def scripted_gateway(loop_thread: LoopThread, sqlite_url: str) -> Iterator[tuple[str, Seen]]:
    """A gateway over one scripted upstream that also serves vLLM-style ``/metrics``."""
    seen = Seen()
    upstream = with_vllm_metrics(make_upstream(Script(tokens=5, token_delay_s=0.005), seen), seen)
    with app_in_thread(loop_thread, lambda: upstream) as up, \
            app_in_thread(loop_thread, lambda: create_app(gateway_settings(sqlite_url, [up]))
                          ) as gw:
        yield gw, seen


@contextlib.contextmanager
def entered(loop: LoopThread, cm: contextlib.AbstractAsyncContextManager[Any]) -> Iterator[Any]:
    """Enter an async context manager on the loop thread (for servers living there)."""
    value = loop.run(cm.__aenter__())
    try:
        yield value
    finally:
        loop.run(cm.__aexit__(None, None, None))


@dataclass
class Workload:
    """Emulated agents: multi-turn chats with tool pauses, over trajectory-scoped URLs."""

    gateway: str
    model: str
    trajectories: int = 24
    turns: tuple[int, int] = (3, 9)
    tool_s: tuple[float, float] = (0.05, 0.6)
    max_tokens: tuple[int, int] = (16, 160)
    seed: int = 7
    done: int = 0
    errors: list[str] = field(default_factory=list)

    async def run(self) -> None:
        rng = random.Random(self.seed)
        limits = httpx.Limits(max_connections=256)
        # one token for the agents' model calls and the rewards (harness and trainer)
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(timeout=120, limits=limits, headers=auth) as client:
            await asyncio.gather(*(self._agent(client, i, rng.randint(*self.turns),
                                               random.Random(rng.random()))
                                   for i in range(self.trajectories)))

    async def _agent(self, client: httpx.AsyncClient, i: int, turns: int,
                     rng: random.Random) -> None:
        group = f"g{i % 4}"
        base = f"{self.gateway}/g/{group}/t/{group}-traj-{i:03d}/v1/chat/completions"
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."},
                                          {"role": "user", "content": f"Task {i % 4}: fix it."}]
        await asyncio.sleep(rng.uniform(0, 0.5))
        for turn in range(turns):
            body = {"model": self.model, "messages": messages, "stream": turn % 2 == 0,
                    "max_tokens": rng.randint(*self.max_tokens)}
            try:
                reply = await self._call(client, base, body)
            except (httpx.HTTPError, ValueError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"tool output {turn}: " + "ok " * 20}]
            await asyncio.sleep(rng.uniform(*self.tool_s))
        await client.post(f"{self.gateway}/trajectories/{group}-traj-{i:03d}/finish",
                          json={"reward": rng.random()})
        self.done += 1

    async def _call(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str:
        if not body["stream"]:
            r = await client.post(url, json=body)
            r.raise_for_status()
            return str(r.json()["choices"][0]["message"]["content"] or "")
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            return "".join([line async for line in r.aiter_lines()])[:200]


def start_workload(loop: LoopThread, workload: Workload) -> Future[None]:
    return asyncio.run_coroutine_threadsafe(workload.run(), loop.loop)
