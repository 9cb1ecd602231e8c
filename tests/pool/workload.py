"""A multi-turn agent-like workload through the gateway, counting every failed call."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.pool.conftest import ADMIN


@dataclass
class Tally:
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    trajectories: set[str] = field(default_factory=set)


async def trajectory(client: httpx.AsyncClient, tid: str, model: str, stop: asyncio.Event,
                     tally: Tally, *, max_tokens: int = 8, max_turns: int = 1000,
                     gap_s: float = 0.05, extra: dict[str, Any] | None = None) -> None:
    """Turns until ``stop`` is set: call, append the answer and a tool result, repeat."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {tid}: go"}]
    tally.trajectories.add(tid)
    for turn in range(max_turns):
        if stop.is_set():
            return
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                **(extra or {})}
        try:
            r = await client.post(f"/t/{tid}/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            tally.failed.append(f"{tid}#{turn}: {type(exc).__name__}: {exc}")
            return
        if r.status_code != 200:
            tally.failed.append(f"{tid}#{turn}: HTTP {r.status_code} {r.text[:300]}")
            return
        tally.ok += 1
        content = r.json()["choices"][0]["message"].get("content") or ""
        messages += [{"role": "assistant", "content": content[:200]},
                     {"role": "user", "content": f"tool output {turn}"}]
        if len(messages) > 12:  # keep the context small: the tiny model has 2048 tokens
            messages = [messages[0], *messages[-6:]]
        await asyncio.sleep(gap_s)


async def wait_job(client: httpx.AsyncClient, job_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job: dict[str, Any] = (await client.get(f"/admin/jobs/{job_id}", headers=ADMIN)).json()
        if job["status"] not in ("pending", "running"):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job['status']} after {timeout_s} s: {job}")
        await asyncio.sleep(0.1)


async def calls_of(client: httpx.AsyncClient, tids: set[str]) -> list[dict[str, Any]]:
    """Every recorded call of ``tids`` (from the trace store)."""
    out: list[dict[str, Any]] = []
    for tid in sorted(tids):
        r = await client.get(f"/trajectories/{tid}", headers=ADMIN)
        r.raise_for_status()
        out += r.json()["calls"]
    return out
