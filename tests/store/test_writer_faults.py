"""The trace writer cannot die, and never loses a record silently (issue 41).

Each fault is real where it can be: Postgres rejects a value its column cannot take, a
trigger ends the writer's own connection in the middle of the row-by-row retry (a blip),
the database is cut with a TCP relay, the spool sits on a 64 KiB tmpfs that fills or is
remounted read-only. The one fault no real component will produce on demand, a bug in
the loop itself, is a spool whose ``append`` raises once (a typed fake of the component
the writer is given).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import select

from gateway.config import TraceSettings
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.models import Call
from gateway.store.quarantine import Quarantine
from gateway.store.records import CallRecord
from gateway.store.spool import Appended, Spool
from gateway.store.writer import TraceWriter
from tests.conftest import PG_ADMIN_DSN
from tests.store.relay import TcpRelay

FAST = TraceSettings(batch_size=20, flush_interval_s=0.02, retry_backoff_s=0.05,
                     retry_backoff_max_s=0.2)


def _rec(tid: str, i: int, **kw: object) -> CallRecord:
    rec = CallRecord(id=uuid.uuid4().hex, trajectory_id=tid, group_id=None, seq=i,
                     endpoint="chat", model="m", weight_version="0", started_at=time.time(),
                     prompt_delta=[1, 2, 3], completion_ids=[4, 5])
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


async def _stored(url: str, tid: str) -> list[int]:
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as s:
            q = select(Call.seq).where(Call.trajectory_id == tid).order_by(Call.seq)
            return list((await s.execute(q)).scalars())
    finally:
        await engine.dispose()


def _dsn(url: str) -> str:
    return PG_ADMIN_DSN.rsplit("/", 1)[0] + "/" + url.rsplit("/", 1)[1]


@contextlib.asynccontextmanager
async def _blip_on(url: str, model: str) -> AsyncIterator[None]:
    """The first insert of a call whose model is ``model`` ends its own connection (what a
    Postgres restart or a cut does to a writer mid-statement); later ones go through. A
    sequence counts the tries: unlike a table, it is not rolled back with the insert."""
    conn = await asyncpg.connect(_dsn(url))
    tag = uuid.uuid4().hex[:8]
    await conn.execute(f"""
        CREATE SEQUENCE blip_{tag};
        CREATE FUNCTION blip_{tag}() RETURNS trigger AS $$
        BEGIN
          IF NEW.model = '{model}' AND nextval('blip_{tag}') = 1 THEN
            PERFORM pg_terminate_backend(pg_backend_pid());
          END IF;
          RETURN NEW;
        END $$ LANGUAGE plpgsql;
        CREATE TRIGGER blip_{tag} BEFORE INSERT ON calls FOR EACH ROW
          EXECUTE FUNCTION blip_{tag}();""")
    try:
        yield
    finally:
        await conn.execute(f"DROP TRIGGER blip_{tag} ON calls; DROP FUNCTION blip_{tag}(); "
                           f"DROP SEQUENCE blip_{tag};")
        await conn.close()


@pytest.mark.postgres
async def test_a_rejected_batch_with_a_blip_in_its_row_by_row_retry(postgres_url: str,
                                                                   tmp_path: Path):
    """Was: the blip escaped the rejected-batch handler and killed the writer (7,508 calls
    answered, 3 stored; /admin/flush waited 30 s)."""
    tid = f"blip-{uuid.uuid4().hex[:8]}"
    blip = f"blip-{tid}"
    engine = make_engine(postgres_url)
    writer = TraceWriter(make_sessionmaker(engine), FAST, Spool(tmp_path / "s.jsonl", 10**8))
    writer.start()
    try:
        async with _blip_on(postgres_url, blip):
            batch = [_rec(tid, 0), _rec(tid, 1, model="m" * 300),  # too long for its column
                     _rec(tid, 2), _rec(tid, 3, model=blip), _rec(tid, 4)]
            for rec in batch:
                assert writer.submit(rec)
            assert await writer.drain(15)
        assert await _stored(postgres_url, tid) == [0, 2, 3, 4]
        assert writer.rejected == 1 and writer.quarantine is not None
        assert writer.quarantine.counts == {"rejected": 1}
        assert writer.write_errors >= 1 and writer.db_ok  # the blip, then recovered
        assert writer.running and writer.restarts == 0 and writer.refusal is None
        for i in range(5, 25):  # and it goes on writing
            assert writer.submit(_rec(tid, i))
        assert await writer.drain(10)
        assert await _stored(postgres_url, tid) == [0, 2, 3, 4, *range(5, 25)]
    finally:
        await writer.close()
        await engine.dispose()


@pytest.mark.postgres
async def test_a_record_no_encoder_takes_is_quarantined(postgres_url: str, tmp_path: Path):
    """Was: request messages nested 300 levels (orjson's limit is 255) killed the writer
    on Postgres, and every later call went unrecorded."""
    tid = f"deep-{uuid.uuid4().hex[:8]}"
    deep: object = "leaf"
    for _ in range(300):
        deep = [deep]
    engine = make_engine(postgres_url)
    writer = TraceWriter(make_sessionmaker(engine), FAST, Spool(tmp_path / "s.jsonl", 10**8))
    writer.start()
    try:
        assert writer.submit(_rec(tid, 0))
        assert writer.submit(_rec(tid, 1, request_messages=[{"role": "user", "x": deep}]))
        for i in range(2, 22):
            assert writer.submit(_rec(tid, i))
        assert await writer.drain(10)
        assert await _stored(postgres_url, tid) == [0, *range(2, 22)]
        assert writer.quarantine is not None and writer.quarantine.counts == {"rejected": 1}
        assert writer.running and writer.restarts == 0
    finally:
        await writer.close()
        await engine.dispose()


class SpoolWithABug(Spool):
    """A spool whose first append raises an error no handler expects."""

    failed = False

    def append(self, records: list[CallRecord]) -> Appended:  # type: ignore[override]
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug in the spool")
        return super().append(records)


@contextlib.asynccontextmanager
async def _relay() -> AsyncIterator[TcpRelay]:
    relay = TcpRelay(5432)
    await relay.up()
    try:
        yield relay
    finally:
        with contextlib.suppress(Exception):
            await relay.down()


@pytest.mark.postgres
async def test_the_loop_restarts_after_a_failure_and_refuses_calls_meanwhile(
        postgres_url: str, tmp_path: Path):
    tid = f"bug-{uuid.uuid4().hex[:8]}"
    async with _relay() as relay:
        engine = make_engine(postgres_url.replace(":5432", f":{relay.port}"))
        settings = FAST.model_copy(update={"retry_backoff_s": 0.5, "retry_backoff_max_s": 1.0})
        writer = TraceWriter(make_sessionmaker(engine), settings,
                             SpoolWithABug(tmp_path / "s.jsonl", 10**8))
        writer.start()
        try:
            await relay.down()  # the batch will go to the spool, which raises
            assert writer.submit(_rec(tid, 0))
            refusals = []
            deadline = time.monotonic() + 5
            while writer.restarts == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert writer.restarts == 1 and "a bug in the spool" in (writer.failure or "")
            refusals.append(writer.refusal)
            assert refusals[0] is not None and "restarts" in refusals[0]
            while not writer.running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert writer.running and writer.refusal is None  # back, and recording
            for i in range(1, 11):  # still down: these go to the (now working) spool
                assert writer.submit(_rec(tid, i))
            await asyncio.sleep(0.3)
            assert writer.spooled >= 10
            await relay.up()
            assert await writer.drain(15)
            assert await _stored(postgres_url, tid) == list(range(1, 11))
            assert writer.quarantine is not None
            assert writer.quarantine.counts == {"writer_failure": 1}  # record 0: kept there
            assert writer.dropped == 0
        finally:
            await writer.close()
            await engine.dispose()


@contextlib.contextmanager
def _tiny_disk(at: Path) -> Iterator[Path]:
    at.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(at)], check=True)
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], check=True)


@pytest.mark.postgres
@pytest.mark.parametrize("fault", ["full", "read-only"])
async def test_a_spool_disk_that_fails_during_an_outage(postgres_url: str, tmp_path: Path,
                                                        fault: str):
    """Was: 6,788 of 7,711 (full) and 6,626 of 7,480 (read-only) calls not stored, none
    counted. Now the spool's refusals stay in memory; past memory, records are refused at
    the door (counted, and the writer says calls must be refused) instead of vanishing."""
    tid = f"disk-{uuid.uuid4().hex[:8]}"
    async with _relay() as relay:
        engine = make_engine(postgres_url.replace(":5432", f":{relay.port}"))
        settings = FAST.model_copy(update={"queue_size": 20, "overflow_size": 60})
        with _tiny_disk(tmp_path / "disk") as disk:
            spool = Spool(disk / "s.jsonl", 10**9, quarantine=Quarantine(tmp_path / "q.jsonl"))
            writer = TraceWriter(make_sessionmaker(engine), settings, spool)
            writer.start()
            try:
                await relay.down()
                if fault == "read-only":
                    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
                accepted, refused, refusal = [], 0, None
                for i in range(400):
                    if writer.submit(_rec(tid, i)):
                        accepted.append(i)
                    else:
                        refused += 1
                        refusal = refusal or writer.refusal
                    if i % 10 == 0:
                        await asyncio.sleep(0.01)
                assert refused > 0 and writer.lost == {"memory_full": refused}
                assert refusal is not None and "trace buffer is full" in refusal
                assert writer.spool_error is not None
                await relay.up()
                assert await writer.drain(30)
                assert await _stored(postgres_url, tid) == accepted  # every accepted one
                assert writer.refusal is None and writer.db_ok
            finally:
                await writer.close()
                await engine.dispose()
