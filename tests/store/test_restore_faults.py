"""The restore lookup under store faults: it waits for the store, never guesses.

Faults are real: Postgres backends terminated from an admin connection
(``pg_terminate_backend``), a lock held on the tables, a port that refuses connections,
and a write lock that keeps the trace writer from storing what it holds. A call on a
trajectory the gateway does not hold is either restored exactly or refused with
:class:`StoreUnavailable` (503 + Retry-After); it is never served as new on a guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.config import RestoreSettings, TraceSettings
from gateway.errors import StoreUnavailable
from gateway.store import queries
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.records import CallRecord
from gateway.store.spool import Spool
from gateway.store.writer import TraceWriter
from gateway.trajectories.restore import Restorer
from gateway.trajectories.tracker import Tracker
from tests.conftest import PG_ADMIN_DSN
from tests.store.relay import TcpRelay

CALLS = 3  # recorded calls per known trajectory


def _pg_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


def _rec(tid: str, seq: int) -> CallRecord:
    """The ``seq``-th call of a one-branch trajectory: each prompt extends the last."""
    return CallRecord(id=f"{tid}-{seq}", trajectory_id=tid, group_id="g", seq=seq,
                      endpoint="chat", model="m", weight_version="0",
                      started_at=time.time() + seq, prompt_offset=3 * seq,
                      prompt_delta=[seq + 1], prompt_len=3 * seq + 1,
                      completion_ids=[100 + seq, 200 + seq], completion_logprobs=[-0.5] * 2)


async def _store(sm: async_sessionmaker[AsyncSession], records: list[CallRecord]) -> None:
    writer = TraceWriter(sm, TraceSettings(flush_interval_s=0.01))
    writer.start()
    try:
        for rec in records:
            assert writer.submit(rec)
        assert await writer.drain(10)
    finally:
        await writer.close()


@contextlib.asynccontextmanager
async def _terminating(url: str, every_s: float) -> AsyncIterator[Counter[str]]:
    """Terminate every other backend of ``url``'s database every ``every_s`` while the
    block runs (as an operator, a failover or a pooler restart does)."""
    database = url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(PG_ADMIN_DSN)
    count: Counter[str] = Counter()

    async def kill() -> None:
        while True:
            await asyncio.sleep(every_s)
            count["terminated"] += len(await admin.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = $1 AND pid <> pg_backend_pid()", database))

    killer = asyncio.create_task(kill())
    try:
        yield count
    finally:
        killer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await killer
        await admin.close()


@contextlib.asynccontextmanager
async def _pg_lock(url: str, tables: str, mode: str) -> AsyncIterator[None]:
    """Hold a lock on ``tables`` while the block runs (released at its end)."""
    conn = await asyncpg.connect(_pg_dsn(url))
    try:
        async with conn.transaction():
            await conn.execute(f"LOCK TABLE {tables} IN {mode} MODE")
            yield
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def _write_lock(url: str) -> AsyncIterator[None]:
    """Keep every writer out of the database while the block runs (readers go on)."""
    if url.startswith("postgresql"):
        async with _pg_lock(url, "trajectories, calls", "EXCLUSIVE"):
            yield
        return
    conn = sqlite3.connect(url.split(":///", 1)[1], isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def _later(seconds: float, fn: Callable[[], Awaitable[object]]) -> object:
    await asyncio.sleep(seconds)
    return await fn()


# --------------------------------------------------------------------------- the engine


@pytest.mark.postgres
async def test_a_terminated_connection_is_never_handed_out_again(postgres_url: str) -> None:
    """asyncpg's ``cannot switch to state 15; another operation (2) is in progress``.

    ``pg_terminate_backend`` makes the server send each connection a termination notice,
    then close it. A pooled connection that has read the notice but not yet the close
    (a pooler or a slow link in between; a busy event loop for one iteration) is in
    asyncpg's error state (2) with its socket open: ``is_closed()`` is still false, so
    SQLAlchemy did not count the error as a disconnect, the pre-ping raised it instead of
    replacing the connection, and every checkout of it failed until the close arrived.
    The relay holds the close back for 2 s to make that window certain."""
    relay = TcpRelay(5432, close_delay_s=2.0)
    await relay.up()
    engine = make_engine(postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}"))
    sm = make_sessionmaker(engine)
    try:
        await _store(sm, [_rec(f"kill-{i}", s) for i in range(8) for s in range(CALLS)])

        async def restore_point(tid: str, hold_s: float = 0.0) -> int:
            async with sm() as session:
                point = await queries.restore_point(session, trajectory_id=tid)
                await asyncio.sleep(hold_s)
            assert point is not None
            return len(point.calls)

        # eight connections in the pool, then every backend terminated
        await asyncio.gather(*(restore_point(f"kill-{i}", 0.05) for i in range(8)))
        async with _terminating(postgres_url, every_s=0.0):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the notices have arrived; the closes have not
        got = await asyncio.gather(*(restore_point(f"kill-{i}") for i in range(8)),
                                   return_exceptions=True)
        assert got == [CALLS] * 8, [str(g)[:150] for g in got if isinstance(g, Exception)]
    finally:
        await relay.down()  # first: a graceful close through it would wait for each one
        await engine.dispose()


# --------------------------------------------------------------------------- the restorer


@pytest.mark.postgres
async def test_terminated_connections_never_fail_or_fake_a_restore(postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    sm = make_sessionmaker(engine)
    ids = [f"term-{i}" for i in range(30)]
    await _store(sm, [_rec(t, s) for t in ids for s in range(CALLS)])
    waves = retries = 0
    try:
        async with _terminating(postgres_url, every_s=0.5) as killed:
            # a fresh gateway's first calls, wave after wave: 3 s, and on (up to 15 s) until
            # a termination has landed on a lookup (on a loaded machine the first 3 s can
            # see every termination land between waves: 12 waves, 50 kills, none in a query)
            start = time.monotonic()
            while time.monotonic() < start + 3.0 or (retries == 0
                                                     and time.monotonic() < start + 15.0):
                restorer = Restorer(Tracker(), sm, settings=RestoreSettings(wait_s=10))
                new = [f"new-{waves}-{i}" for i in range(10)]
                got = await asyncio.gather(*(restorer.restore(t) for t in [*ids, *new]))
                for tid, state in zip(ids, got, strict=False):
                    assert state is not None and state.id == tid, tid
                    assert state.recorded == CALLS and len(state.sequence) == 3 * CALLS
                assert got[len(ids):] == [None] * len(new)
                assert restorer.failures == 0
                retries += restorer.retries
                waves += 1
        print(f"\n{waves} waves of 40 restores, {killed['terminated']} backends terminated, "
              f"{retries} lookups tried again, 0 refused")
        assert killed["terminated"] > 0 and retries > 0, (killed, retries, waves)
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_a_lock_on_the_tables_holds_first_calls_until_it_is_released(
        postgres_url: str) -> None:
    """The issue's stall: a lock on ``trajectories, calls`` after a restart. The first
    calls wait for it and are restored exactly (known ids) or start fresh (new ids)."""
    engine = make_engine(postgres_url)
    sm = make_sessionmaker(engine)
    await _store(sm, [_rec("locked-known", s) for s in range(CALLS)])
    restorer = Restorer(Tracker(), sm, settings=RestoreSettings(wait_s=5, query_timeout_s=0.3))
    try:
        async with _pg_lock(postgres_url, "trajectories, calls", "ACCESS EXCLUSIVE"):
            t0 = time.monotonic()
            pending = asyncio.gather(restorer.restore("locked-known"),
                                     *(restorer.restore(f"locked-new-{i}") for i in range(50)))
            await asyncio.sleep(1.0)
            assert not pending.done()
        got = await pending
        waited = time.monotonic() - t0
        known, new = got[0], got[1:]
        assert known is not None and known.recorded == CALLS and not known.finished_at
        assert new == [None] * 50
        assert 1.0 <= waited < 3.0, waited
        assert restorer.failures == 0 and restorer.retries >= 1  # timed-out tries, retried
        assert restorer.existence_queries <= 10  # one batch, tried again: not one per id
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_a_stall_longer_than_the_wait_refuses_the_call(postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    sm = make_sessionmaker(engine)
    await _store(sm, [_rec("stalled", s) for s in range(CALLS)])
    tracker = Tracker()
    restorer = Restorer(tracker, sm, settings=RestoreSettings(wait_s=0.4, retry_after_s=3))
    try:
        async with _pg_lock(postgres_url, "trajectories, calls", "ACCESS EXCLUSIVE"):
            t0 = time.monotonic()
            for tid in ("stalled", "never-seen"):  # known or not, nobody can tell yet
                with pytest.raises(StoreUnavailable) as caught:
                    await restorer.restore(tid)
                assert caught.value.status_code == 503
                assert caught.value.headers == {"Retry-After": "3"}
                assert "not run" in caught.value.message
            assert time.monotonic() - t0 < 2.0
            assert tracker.get("stalled") is None and tracker.get("never-seen") is None
        state = await restorer.restore("stalled")  # the store is back: the call goes on
        assert state is not None and state.recorded == CALLS
        assert await restorer.restore("never-seen") is None
        assert restorer.failures == 2
    finally:
        await engine.dispose()


async def test_an_unreachable_store_refuses_unknown_ids() -> None:
    engine = make_engine("postgresql+asyncpg://postgres@127.0.0.1:1/nothing")  # refused
    try:
        restorer = Restorer(Tracker(), make_sessionmaker(engine),
                            settings=RestoreSettings(wait_s=0.5))
        got = await asyncio.gather(*(restorer.restore(f"t{i}") for i in range(8)),
                                   return_exceptions=True)
        assert all(isinstance(g, StoreUnavailable) for g in got), got
        assert restorer.failures == 8 and restorer.retries >= 2  # the batch was retried
        assert restorer.existence_queries < 20  # together, not once per id
        assert restorer.last_error is not None
    finally:
        await engine.dispose()


# --------------------------------------------------------------------------- the writer


async def test_restore_waits_for_the_spool_an_earlier_process_left(
        db_url: str, tmp_path: Path) -> None:
    """A restarted gateway whose predecessor spooled calls (its database was down at
    shutdown): the first call must see them, or its ``seq`` would repeat theirs."""
    tid = f"spooled-{tmp_path.name[-6:]}"
    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    await _store(sm, [_rec(tid, 0)])  # the predecessor wrote one call...
    with Spool(tmp_path / "spool.jsonl", 10**6) as spool:
        assert spool.append([_rec(tid, 1), _rec(tid, 2)]).kept == 2  # ...and spooled two
    writer = TraceWriter(sm, TraceSettings(flush_interval_s=0.01, retry_backoff_s=0.05),
                         Spool(tmp_path / "spool.jsonl", 10**6))
    restorer = Restorer(Tracker(), sm, settings=RestoreSettings(wait_s=5),
                        written=lambda t, s: writer.stored(t, timeout_s=s))
    try:
        async with _write_lock(db_url):
            writer.start()  # its replay waits on the lock
            pending = asyncio.create_task(restorer.restore(tid))
            await asyncio.sleep(0.5)
            assert not pending.done()  # the database alone says 1 call: not enough
        state = await pending
        assert state is not None and state.recorded == 3 and len(state.sequence) == 9
    finally:
        await writer.close()
        await engine.dispose()


async def test_restore_waits_for_its_own_writer(db_url: str) -> None:
    """An id this gateway forgot (evicted) while its records were still queued."""
    tid = f"queued-{time.monotonic_ns()}"
    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    writer = TraceWriter(sm, TraceSettings(flush_interval_s=0.01))
    writer.start()
    restorer = Restorer(Tracker(), sm, settings=RestoreSettings(wait_s=0.3),
                        written=lambda t, s: writer.stored(t, timeout_s=s))
    try:
        async with _write_lock(db_url):
            for s in range(CALLS):
                assert writer.submit(_rec(tid, s))
            with pytest.raises(StoreUnavailable):  # still queued after the wait: refused
                await restorer.restore(tid)
            restorer.settings = RestoreSettings(wait_s=5)
            pending = asyncio.create_task(restorer.restore(tid))
            await asyncio.sleep(0.3)
            assert not pending.done()
        state = await pending
        assert state is not None and state.recorded == CALLS
    finally:
        await writer.close()
        await engine.dispose()
