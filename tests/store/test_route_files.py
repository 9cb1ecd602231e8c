"""Segment files for routed experts: appends read back, one writer a segment, roll-over,
what a retention may delete, and a disk that refuses them losing the routes, not the
trace."""

from __future__ import annotations

import asyncio
import base64
import errno
import io
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from gateway.config import TraceSettings
from gateway.store import queries
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.records import CallRecord
from gateway.store.route_files import RouteFiles, RouteRef, created_at, default_routes_dir
from gateway.store.writer import TraceWriter


def test_appends_read_back_where_their_references_say(tmp_path: Path) -> None:
    files = RouteFiles(tmp_path / "r")
    blobs = [b"a" * 10, b"", b"xyz" * 1000]
    refs = files.append(blobs)
    more = files.append([b"last"])
    assert [files.read(r) for r in [*refs, *more]] == [*blobs, b"last"]
    assert {r.segment for r in [*refs, *more]} == {p.name for p in (tmp_path / "r").iterdir()}
    assert more[0].offset == sum(len(b) for b in blobs)
    assert files.read(RouteRef(refs[0].segment, 0, 10**6)) is None  # shorter than said
    assert files.read(RouteRef("1-gone.routes", 0, 1)) is None
    for bad in ("../r/" + refs[0].segment, "", ".."):
        assert files.read(RouteRef(bad, 0, 1)) is None


def test_a_segment_rolls_over_by_size_and_age_and_has_one_writer(tmp_path: Path) -> None:
    clock = [1_000.0]
    one = RouteFiles(tmp_path, segment_bytes=100, segment_age_s=60, clock=lambda: clock[0])
    two = RouteFiles(tmp_path, segment_bytes=100, segment_age_s=60, clock=lambda: clock[0])
    a = one.append([b"x" * 60])[0]
    b = two.append([b"y" * 60])[0]  # the same millisecond: still a segment of its own
    assert a.segment != b.segment and created_at(a.segment) == created_at(b.segment) == 1000
    assert one.append([b"x" * 60])[0].segment == a.segment  # under 100 bytes when it began
    c = one.append([b"x"])[0]
    assert c.segment != a.segment  # past 100 bytes: a new one
    clock[0] += 61
    d = one.append([b"x"])[0]
    assert d.segment != c.segment and created_at(d.segment) == 1061
    # a restarted process never appends to what the last one left
    three = RouteFiles(tmp_path, clock=lambda: clock[0])
    assert three.append([b"z"])[0].segment not in {a.segment, b.segment, c.segment, d.segment}
    assert one.read(a) == b"x" * 60 and two.read(b) == b"y" * 60


def test_only_segments_that_take_no_more_appends_and_predate_a_cutoff_are_sealed(
        tmp_path: Path) -> None:
    clock = [1_000.0]
    files = RouteFiles(tmp_path, segment_age_s=60, clock=lambda: clock[0])
    old = files.append([b"old"])[0].segment
    clock[0] = 1_100.0
    new = files.append([b"new"])[0].segment
    (tmp_path / "notes.txt").write_text("not a segment")
    assert [n for n, _ in files.segments()] == [old, new]
    assert files.sealed_before(1_050.0) == []  # ``old`` could still take appends until 1060
    assert files.sealed_before(1_061.0) == [old]
    assert files.sealed_before(10_000.0) == [old, new]
    files.delete(new)  # this process's open segment: it moves on to another
    after = files.append([b"after"])[0]
    assert after.segment not in (old, new) and files.read(after) == b"after"
    files.delete(old)
    files.delete(old)  # already gone: nothing to do
    assert [n for n, _ in files.segments()] == [after.segment]


def test_the_default_directory_is_beside_an_sqlite_file_else_per_database(
        tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    assert default_routes_dir(f"sqlite+aiosqlite:///{db}") == tmp_path / "g.db.routes"
    pg = default_routes_dir("postgresql+asyncpg://u@h/db1")
    assert pg.parent.name == "routes" and pg != default_routes_dir("postgresql+asyncpg://u@h/db2")


def _routed(tid: str, seq: int = 0) -> CallRecord:
    buf = io.BytesIO()
    np.save(buf, np.full((3, 2, 2), seq, dtype=np.uint8))
    return CallRecord(id=f"{tid}-{seq}", trajectory_id=tid, group_id=None, seq=seq,
                      endpoint="chat", model="m", weight_version="v1", started_at=time.time(),
                      prompt_len=2, prompt_delta=[1, 2], completion_ids=[3, 4],
                      routes=[[0, base64.b64encode(buf.getvalue()).decode()]])


class FullDisk(RouteFiles):
    """A disk that takes the segment's creation, then refuses the bytes (ENOSPC)."""

    def write(self, refs: Sequence[RouteRef], blobs: Sequence[bytes]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("disk", ["no directory", "full"])
async def test_a_disk_that_refuses_routes_loses_them_counted_and_keeps_the_tokens(
        sqlite_url: str, tmp_path: Path, disk: str) -> None:
    """The segment directory cannot be made (a file is in its way), or the disk refuses
    the bytes after the segment was made: the writer stores the calls without their
    routes (no row points into the files), counts and logs it, and goes on."""
    (tmp_path / "blocked").write_text("a file, not a directory")
    files = RouteFiles(tmp_path / "blocked" / "routes") if disk == "no directory" else \
        FullDisk(tmp_path / "routes")
    engine = make_engine(sqlite_url)
    writer = TraceWriter(make_sessionmaker(engine, files),
                         TraceSettings(flush_interval_s=0.01), route_files=files)
    writer.start()
    try:
        assert writer.submit(_routed("blocked"))
        assert await writer.drain(10)
        assert writer.written == 1 and writer.routes_unwritten == 1 and writer.dropped == 0
        async with make_sessionmaker(engine, files)() as session:
            [call] = await queries.get_calls(session, trajectory_id="blocked")
        assert call.routes is None and call.routes_file is None and call.routes_start is None
        assert call.completion_ids  # the tokens are stored
    finally:
        await writer.close()
        await engine.dispose()


async def test_routes_on_disk_wait_in_the_spool_as_references_while_the_database_is_down(
        tmp_path: Path) -> None:
    """The database unreachable when a batch comes: its routes are already in a segment
    (written once), the records wait in the spool holding where, and the rows written
    once it answers read them back."""
    from gateway.store.db import upgrade
    from gateway.store.spool import Spool

    db = tmp_path / "late.db"
    url = f"sqlite+aiosqlite:///{db}"
    files = RouteFiles(tmp_path / "routes")
    (tmp_path / "late.db").mkdir()  # the database cannot be opened yet
    engine = make_engine(url)
    spool = Spool(tmp_path / "spool.jsonl", 1 << 24)
    writer = TraceWriter(make_sessionmaker(engine, files),
                         TraceSettings(flush_interval_s=0.01, retry_backoff_s=0.05,
                                       retry_backoff_max_s=0.1), spool, route_files=files)
    writer.start()
    try:
        for seq in range(3):
            assert writer.submit(_routed("late", seq))
        deadline = time.monotonic() + 10
        while writer.spooled < 3:
            assert time.monotonic() < deadline, "nothing spooled"
            await asyncio.sleep(0.05)
        on_disk = sum(p.stat().st_size for p in files.root.iterdir())
        (tmp_path / "late.db").rmdir()
        await asyncio.to_thread(upgrade, url)
        assert await writer.drain(15)
        async with make_sessionmaker(engine, files)() as session:
            calls = await queries.get_calls(session, trajectory_id="late")
        assert [np.load(io.BytesIO(c.routes or b"")).max() for c in calls] == [0, 1, 2]
        assert sum(p.stat().st_size for p in files.root.iterdir()) == on_disk  # once
    finally:
        await writer.close()
        await engine.dispose()


@pytest.mark.parametrize("segment", ["1700000000000-ab.routes", "17-x.routes"])
def test_a_segment_name_says_when_it_was_made(segment: str) -> None:
    assert created_at(segment) == int(segment.split("-")[0]) / 1000
    assert created_at("notes.txt") is None and created_at("x-1.routes") is None
