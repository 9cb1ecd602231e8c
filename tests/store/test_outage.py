"""The trace writer loses nothing while its database is unreachable.

A real outage is staged with a TCP relay in front of Postgres that is switched off and
on: the writer's connections really fail, records move to the spool file, and everything
arrives once the relay is back. The spool also carries records across a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from gateway.config import TraceSettings
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.models import Call
from gateway.store.records import CallRecord
from gateway.store.spool import Spool
from gateway.store.writer import TraceWriter
from tests.store.relay import TcpRelay


def _rec(i: int) -> CallRecord:
    return CallRecord(id=f"c{i:06d}", trajectory_id=f"t{i % 7}", group_id=None, seq=i,
                      endpoint="chat", model="m", weight_version="0", started_at=time.time(),
                      prompt_delta=[1, 2, 3], completion_ids=[4, 5])


async def _count(url: str) -> int:
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as s:
            return int((await s.execute(select(func.count()).select_from(Call))).scalar_one())
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_outage_spools_and_recovers_without_loss(postgres_url: str, tmp_path: Path):
    relay = TcpRelay(5432)
    await relay.up()
    url = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")
    before = await _count(postgres_url)
    engine = make_engine(url)
    writer = TraceWriter(make_sessionmaker(engine),
                         TraceSettings(queue_size=50, batch_size=20, flush_interval_s=0.02,
                                       retry_backoff_s=0.05, retry_backoff_max_s=0.2),
                         Spool(tmp_path / "spool.jsonl", 10**8))
    writer.start()
    try:
        for i in range(100):
            assert writer.submit(_rec(i))
            if i % 40 == 0:
                await asyncio.sleep(0.05)
        assert await writer.drain(10)
        await relay.down()
        for i in range(100, 400):  # six times the memory queue, while the DB is gone
            assert writer.submit(_rec(i)), f"record {i} refused"
            if i % 40 == 0:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert not writer.db_ok and writer.spooled > 0
        await relay.up()
        assert await writer.drain(30)
        assert writer.dropped == 0
        assert await _count(postgres_url) - before == 400
    finally:
        await writer.close()
        await engine.dispose()
        with contextlib.suppress(Exception):
            await relay.down()


async def test_spool_survives_a_restart(sqlite_url: str, tmp_path: Path):
    spool_path = tmp_path / "spool.jsonl"
    with Spool(spool_path, 10**6) as spool:  # what a stopped process left
        assert spool.append([_rec(i) for i in range(5)]).kept == 5
    engine = make_engine(sqlite_url)
    writer = TraceWriter(make_sessionmaker(engine), TraceSettings(), Spool(spool_path, 10**6))
    writer.start()
    try:
        assert await writer.drain(10)
        assert await _count(sqlite_url) == 5
        assert not spool_path.exists()
    finally:
        await writer.close()
        await engine.dispose()


def test_full_spool_refuses_and_says_which(tmp_path: Path):
    with Spool(tmp_path / "s.jsonl", 2500) as spool:  # room for a few ~630-byte records
        out = spool.append([_rec(i) for i in range(10)])
        assert 0 < out.kept < 10 and len(out.refused) == 10 - out.kept
        assert out.error is not None and "full" in out.error
        records, pos = spool.read(100)
        assert [r.id for r in records] == [f"c{i:06d}" for i in range(out.kept)]
        assert [r.id for r in out.refused] == [f"c{i:06d}" for i in range(out.kept, 10)]
        spool.commit(pos)
        assert spool.pending_bytes == 0
