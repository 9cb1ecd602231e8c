"""Real processes for the sharded-gateway tests: simulated vLLM servers, a fresh Postgres
database per gateway, and ``rollout-gateway serve`` (sharded or not) as a subprocess, with
a small seeded agent batch whose answers depend only on each call's seed, so any layout of
the same batch gives the same samples."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PG_ADMIN_DSN, _pg_admin
from tests.servers import free_port_block

REPO = Path(__file__).resolve().parents[2]
MODEL = "qwen3-14b"


def haproxy_or_fail() -> str:
    path = shutil.which("haproxy")
    if path is None:
        pytest.fail("the sharded-gateway tests need HAProxy 2.6+ (apt-get install haproxy; "
                    ".ci/run installs it)", pytrace=False)
    return path


@pytest.fixture(scope="module")
def sim_servers() -> Iterator[list[str]]:
    """Six simulated vLLM servers (50x time, LoRA adapters loadable), one process."""
    port = free_port_block(6)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "sim-backend", "--port", str(port), "--count", "6",
         "--speed", "50", "--enable-lora"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    urls = [f"http://127.0.0.1:{port + k}" for k in range(6)]
    try:
        wait_http([f"{u}/health" for u in urls], 60)
        yield urls
    finally:
        proc.terminate()
        proc.wait(20)


def wait_http(urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} never answered 200")
            time.sleep(0.2)


def _pg(sql: str) -> None:
    """An admin statement, on a thread of its own (the caller's may run an event loop:
    Playwright's sync API does)."""
    with ThreadPoolExecutor(1) as ex:
        ex.submit(asyncio.run, _pg_admin(sql)).result(60)


@contextmanager
def database() -> Iterator[str]:
    name = f"rg_shard_{uuid.uuid4().hex[:10]}"
    _pg(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    try:
        yield f"{base}/{name}"
    finally:
        _pg(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def gateway(backends: list[str], shards: int, tmp: Path, env: dict[str, str] | None = None,
            pool: Path | None = None, database_url: str | None = None,
            ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``serve`` (``shards`` 1) or ``serve --shards N`` on a fresh database (or on
    ``database_url``), over ``backends`` or the managed pool whose spec is at ``pool``; its
    URL."""
    port = free_port_block(shards + 2)
    with contextlib.nullcontext(database_url) if database_url else database() as db:
        cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port),
               "--database-url", db, "--log-level", "warning",
               *(a for b in backends for a in ("--backend", b)),
               *(["--pool", str(pool)] if pool is not None else [])]
        if shards > 1:
            cmd += ["--shards", str(shards), "--haproxy", haproxy_or_fail(),
                    "--state-dir", str(tmp / f"state-{port}")]
        log = (tmp / f"gateway-{port}.log").open("wb")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http([f"{url}/health"], 90)
            if shards > 1:  # HAProxy's first health checks
                time.sleep(2.5)
            yield url, proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            log.close()


def seed_of(tid: str, turn: int) -> int:
    return sum(ord(c) * 31 ** k for k, c in enumerate(f"{tid}#{turn}")) % 2**31


async def agent(http: httpx.AsyncClient, gid: str, tid: str, turns: int,
                tokens: int = 12) -> list[str]:
    """A seeded multi-turn conversation: each call's answer depends on its seed alone."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"task of {gid}"}]
    finishes = []
    for turn in range(turns):
        r = await http.post(f"/g/{gid}/t/{tid}/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": tokens + 3 * turn,
            "seed": seed_of(tid, turn), "ignore_eos": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        finishes.append(choice["finish_reason"])
        messages += [{"role": "assistant", "content": choice["message"]["content"]},
                     {"role": "user", "content": f"tool result {turn}"}]
    r = await http.post(f"/trajectories/{tid}/finish", json={"reward": 1.0, "group_id": gid})
    r.raise_for_status()
    return finishes


def batch_ids(groups: int = 6, size: int = 3) -> dict[str, list[str]]:
    return {f"grp-{g}": [f"grp-{g}-{m}" for m in range(size)] for g in range(groups)}


async def run_batch(url: str, ids: dict[str, list[str]], turns: int = 3) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(*(agent(http, g, t, turns) for g, ts in ids.items() for t in ts))


def samples(url: str, ids: dict[str, list[str]],
            headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    out = {}
    for tids in ids.values():
        for tid in tids:
            r = httpx.get(f"{url}/trajectories/{tid}/sample", timeout=60, headers=headers)
            assert r.status_code == 200, r.text
            s = r.json()
            out[tid] = {k: s[k] for k in ("trajectory_id", "group_id", "reward", "token_ids",
                                          "loss_mask", "logprobs", "mismatches")}
    return out
