"""A restarted gateway whose store stalls, fails or still holds records: samples stay exact.

The issue this guards against: restart the gateway, then hold a 4 s lock on
``trajectories, calls`` while trajectories continue. Every call used to answer 200 as a
*new* trajectory (``seq`` again from 0, the prompt stored whole on a new branch), leaving
duplicate ``(attempt, seq)`` pairs, mismatches and samples missing half their loss tokens.

Each scenario runs the gateway and a simulated vLLM server as processes on Postgres:
trajectories take 3 turns on a first gateway, which gets SIGTERM; a second process on the
same database (and spool file) takes them on for 3 more turns while the fault is on. The
agents honour ``Retry-After`` on a 503, as the OpenAI SDKs do. Beside them, reference
trajectories run the same prompts and sampling seeds uninterrupted. Every sample must
equal its reference's (tokens, loss mask, logprobs, spans), ``(attempt, seq)`` must run
0..5, no mismatch may appear.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.conftest import PG_ADMIN_DSN
from tests.reliability.procs import Child
from tests.reliability.restarts import (
    RESTART_AT,
    TRAJECTORIES,
    TURNS,
    Tally,
    agents,
    check_as_uninterrupted,
    start_gateway,
    stop_gateway,
    turns,
)
from tests.store.relay import TcpRelay

pytestmark = pytest.mark.postgres
POLICY = "slime"


def _dsn(db: str) -> str:
    return PG_ADMIN_DSN.rsplit("/", 1)[0] + "/" + db.rsplit("/", 1)[1]


@contextlib.asynccontextmanager
async def lock(db: str, seconds: float, mode: str = "ACCESS EXCLUSIVE",
               until: asyncio.Event | None = None) -> AsyncIterator[None]:
    """A lock on ``trajectories, calls`` held for ``seconds`` from the block's start (or
    until ``until`` is set)."""
    conn = await asyncpg.connect(_dsn(db))
    locked = asyncio.Event()

    async def hold() -> None:
        async with conn.transaction():
            await conn.execute(f"LOCK TABLE trajectories, calls IN {mode} MODE")
            locked.set()
            if until is not None:
                await until.wait()
            else:
                await asyncio.sleep(seconds)

    holder = asyncio.create_task(hold())
    await locked.wait()
    try:
        yield
    finally:
        await holder
        await conn.close()


@contextlib.asynccontextmanager
async def terminating(db: str, every_s: float, for_s: float) -> AsyncIterator[Counter[str]]:
    """Terminate every other backend of the database every ``every_s`` for ``for_s``."""
    admin = await asyncpg.connect(_dsn(db))
    count: Counter[str] = Counter()

    async def kill() -> None:
        until = time.monotonic() + for_s
        while time.monotonic() < until:
            rows = await admin.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            count["terminated"] += len(rows)
            await asyncio.sleep(every_s)

    killer = asyncio.create_task(kill())
    try:
        yield count
    finally:
        await killer
        await admin.close()


async def _scenario(sim_children: Callable[..., Child], db: str, tmp_path: Path,
                    fault: Callable[[], contextlib.AbstractAsyncContextManager[Any]], *,
                    env: dict[str, str] | None = None, db_first: str | None = None,
                    before_stop: Callable[[], Any] | None = None,
                    during_start: Callable[[], contextlib.AbstractAsyncContextManager[Any]]
                    | None = None) -> tuple[Tally, dict[str, Any], float]:
    """3 turns on a first gateway (on ``db_first``, default ``db``), SIGTERM, then 3 more
    on a second one while ``fault`` is on; references after. Returns what the agents
    saw after the restart, ``/status`` ``restore``, and how long those turns took."""
    sim = sim_children(speed=50.0)
    run = tmp_path.name[-8:]
    cut, ref = agents(run, "cut"), agents(run, "ref")
    first = await asyncio.to_thread(start_gateway, sim.url, db_first or db, tmp_path, "first",
                                    policy=POLICY)
    tally = Tally()
    second: Child | None = None
    async with httpx.AsyncClient(timeout=90) as http:
        try:
            await turns(http, first.url, cut, RESTART_AT - 1, tally=Tally())
            if before_stop is not None:
                await before_stop()
            await turns(http, first.url, cut, RESTART_AT, tally=Tally())
        finally:
            await stop_gateway(first)
        try:
            async with during_start() if during_start else contextlib.nullcontext():
                second = await asyncio.to_thread(start_gateway, sim.url, db, tmp_path,
                                                 "second", policy=POLICY, env=env)
                t0 = time.monotonic()
                async with fault():
                    await turns(http, second.url, cut, TURNS, tally=tally)
                took = time.monotonic() - t0
            await turns(http, second.url, ref, TURNS, tally=Tally())
            restore = (await check_as_uninterrupted(http, second.url, cut, ref))["restore"]
        finally:
            if second is not None:
                second.stop()
    return tally, restore, took


def _report(name: str, tally: Tally, restore: dict[str, Any], took: float) -> None:
    first = sorted(tally.first_call_s)
    print(f"\n{name}: after the restart {dict(tally.statuses)} "
          f"(503 codes {dict(tally.codes)}, Retry-After {sorted(tally.retry_after)}); "
          f"first call of each trajectory {first[0]:.2f}-{first[-1]:.2f} s; "
          f"3 turns x {TRAJECTORIES} in {took:.1f} s; restore {restore}; "
          f"samples equal to the uninterrupted run: {TRAJECTORIES}/{TRAJECTORIES}")


async def test_store_stall_after_restart_holds_first_calls_then_serves_them_exactly(
        sim_children, postgres_url: str, tmp_path: Path) -> None:
    """The issue's scenario: a 4 s lock just after the restart, calls waiting up to 10 s
    (the default): every call is served once the lock goes, exactly as uninterrupted."""
    tally, restore, took = await _scenario(
        sim_children, postgres_url, tmp_path, lambda: lock(postgres_url, 4.0))
    _report("lock 4 s, wait 10 s", tally, restore, took)
    assert set(tally.statuses) == {200}
    assert min(tally.first_call_s) > 3.0  # they waited for the lock...
    assert restore["restored"] == TRAJECTORIES and restore["failures"] == 0  # ...not guessed


@pytest.mark.parametrize("kind", ["lock", "outage"])
async def test_store_out_longer_than_the_wait_refuses_with_retry_after(
        kind: str, sim_children, postgres_url: str, tmp_path: Path) -> None:
    """A 4 s lock, or the database unreachable for 4 s (a relay switched off), against a
    1 s wait: first calls are refused with 503 ``store_unavailable`` and ``Retry-After``
    (not run, nothing recorded), and served exactly once the store is back."""
    relay = TcpRelay(5432)
    await relay.up()
    via = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")

    @contextlib.asynccontextmanager
    async def outage() -> AsyncIterator[None]:
        await relay.down()
        back = asyncio.create_task(_later(4.0, relay.up))
        try:
            yield
        finally:
            await back

    fault = (lambda: lock(postgres_url, 4.0)) if kind == "lock" else outage
    try:
        tally, restore, took = await _scenario(
            sim_children, via, tmp_path, fault,
            env={"ROLLOUT_GATEWAY_RESTORE__WAIT_S": "1",
                 "ROLLOUT_GATEWAY_RESTORE__RETRY_AFTER_S": "1"})
    finally:
        with contextlib.suppress(Exception):
            await relay.down()
    _report(f"{kind} 4 s, wait 1 s", tally, restore, took)
    assert tally.statuses[503] >= TRAJECTORIES and tally.codes == {
        "store_unavailable": tally.statuses[503]}
    assert tally.retry_after == {"1"}
    assert restore["restored"] == TRAJECTORIES
    assert restore["failures"] == tally.statuses[503]


async def test_connections_terminated_while_restoring(
        sim_children, postgres_url: str, tmp_path: Path) -> None:
    """Postgres terminates the gateway's connections every 0.2 s while the restarted
    gateway restores its trajectories: lookups are tried again on fresh connections."""
    tally, restore, took = await _scenario(
        sim_children, postgres_url, tmp_path,
        lambda: terminating(postgres_url, every_s=0.2, for_s=3.0))
    _report("connections terminated every 0.2 s", tally, restore, took)
    assert set(tally.statuses) == {200}
    assert restore["restored"] == TRAJECTORIES and restore["failures"] == 0


async def test_restart_while_records_wait_in_the_spool(
        sim_children, postgres_url: str, tmp_path: Path) -> None:
    """The first gateway loses its database before the last turn before the restart: those
    records go to its spool file. The second starts while writes are still held up (a
    SHARE lock, as ``CREATE INDEX`` takes: reads go on), so the database alone says one
    turn less: the first calls must wait for the spool to be written, not restore from
    what the database says."""
    relay = TcpRelay(5432)
    await relay.up()
    via = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")

    release = asyncio.Event()
    spool = tmp_path / "spool.jsonl"
    spooled: list[int] = []

    async def cut_db() -> None:
        await relay.down()

    @contextlib.asynccontextmanager
    async def writes_held() -> AsyncIterator[None]:
        spooled.append(spool.stat().st_size if spool.exists() else 0)
        async with lock(postgres_url, 0, mode="SHARE", until=release):
            yield

    @contextlib.asynccontextmanager
    async def released_in_2s() -> AsyncIterator[None]:
        later = asyncio.create_task(_later(2.0, _set(release)))
        try:
            yield
        finally:
            await later

    try:
        tally, restore, took = await _scenario(
            sim_children, postgres_url, tmp_path, released_in_2s,
            db_first=via, before_stop=cut_db, during_start=writes_held)
    finally:
        with contextlib.suppress(Exception):
            await relay.down()
    _report(f"{spooled[0]} bytes in the spool at the restart", tally, restore, took)
    assert spooled[0] > 0  # the first gateway's last turn was in its spool, not the database
    assert set(tally.statuses) == {200}
    assert min(tally.first_call_s) > 1.5  # they waited for the spool to be written
    assert restore["restored"] == TRAJECTORIES and restore["failures"] == 0


async def _later(seconds: float, fn: Callable[[], Any]) -> None:
    await asyncio.sleep(seconds)
    await fn()


def _set(event: asyncio.Event) -> Callable[[], Any]:
    async def set_it() -> None:
        event.set()

    return set_it
