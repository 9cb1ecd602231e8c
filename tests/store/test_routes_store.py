"""Routed experts in the trace store (SQLite and Postgres): a call's pieces merged into one
array, stored as bytes, laid on the sample's positions, exported to Parquet, and
carried through the spool.

The calls of one trajectory, as the gateway records them: turn 0 asked from position 0;
turn 1 was continued across a weight update (two pieces: the aborted request's, then the
continuation's from where the first ended); turn 2 left the sequence (a legacy cut at
position 4 on branch 0), so the routes past the cut are the later call's.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from backends.sim.routes import MoeShape, routed_experts
from gateway.config import TraceSettings
from gateway.store import queries
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.export import export_samples
from gateway.store.records import CallRecord
from gateway.store.route_files import RouteFiles
from gateway.store.routes import coverage, merge
from gateway.store.samples import build_sample
from gateway.store.spool import Spool
from gateway.store.writer import TraceWriter

SHAPE = MoeShape(3, 16, 2)


def _b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _routes(tokens: list[int], start: int, end: int | None = None, salt: str = "") -> str:
    """The engine's answer for ``tokens`` from ``start`` (up to ``end`` positions), under
    the weights ``salt`` names."""
    arr = routed_experts(tokens, start, SHAPE, salt)
    return _b64(arr if end is None else arr[:end - start])


def _rec(traj: str, seq: int, offset: int, delta: list[int], completion: list[int],
         routes: list[list[object]] | None) -> CallRecord:
    return CallRecord(
        id=f"{traj}-{seq}", trajectory_id=traj, group_id=None, seq=seq, endpoint="chat",
        model="m", weight_version="v1", started_at=time.time() + seq, prompt_offset=offset,
        prompt_delta=delta, prompt_len=offset + len(delta), completion_ids=completion,
        completion_logprobs=[-0.5] * len(completion), routes=routes)


def test_pieces_merge_without_gaps_and_report_their_coverage() -> None:
    toks = list(range(100, 130))
    whole = routed_experts(toks, 0, SHAPE)
    pieces: list[list[object]] = [[10, _routes(toks, 10, 20)], [0, _routes(toks, 0, 12)]]
    assert coverage(pieces) == (0, 20)
    merged = merge(pieces)
    assert merged is not None and merged[0] == 0
    assert np.array_equal(np.load(io.BytesIO(merged[1])), whole[:20])
    gap: list[list[object]] = [[0, _routes(toks, 0, 5)], [8, _routes(toks, 8, 12)]]
    assert coverage(gap) == (0, 5)  # what lies past a gap is not held
    merged = merge(gap)
    assert merged is not None and np.array_equal(np.load(io.BytesIO(merged[1])), whole[:5])
    assert coverage([[0, "not base64 of an array"]]) is None
    assert merge([[0, base64.b64encode(b"junk").decode()]]) is None
    # whatever an engine sent, merging never raises (the writer would take it for a
    # database fault and retry the batch for ever)
    for bad in ("", "x", None, 7, base64.b64encode(b"\x93NUMPY").decode()):
        assert merge([[0, bad]]) is None
        assert merge([[0, _routes(toks, 0, 5)], [5, bad]]) is not None
        assert coverage([[0, bad]]) is None


def test_a_branch_holds_routes_per_model() -> None:
    """Two policies on one branch route its tokens each their own way: what one holds
    says nothing of the other's, and a fork holds what its parent held up to it."""
    from gateway.trajectories.branches import Tree

    tree = Tree()
    tree.place([1, 2, 3], [4, 5], routes=(0, 4), model="solver")
    tree.place([1, 2, 3, 4, 5, 6], [7], model="verifier")  # no routes of its own
    (branch,) = tree.branches.values()
    assert branch.routes_end == {"solver": 4}
    tree.place([1, 2, 3, 4, 5, 6, 7, 8], [9], routes=(0, 9), model="verifier")
    assert branch.routes_end == {"solver": 4, "verifier": 9}
    tree.place([1, 2, 9], [10], model="solver")  # a fork at position 2
    fork = tree.branches[1]
    assert fork.parent == 0 and fork.routes_end == {"solver": 2, "verifier": 2}
    tree.place([1, 2, 3, 4, 5, 6, 7, 8, 9, 11], [12], routes=(6, 11), model="solver")
    assert branch.routes_end["solver"] == 4  # a gap (4-6) holds nothing past it


@pytest.mark.parametrize("store", ["files", "database"])
async def test_routes_are_stored_as_bytes_and_aligned_in_samples(db_url: str, store: str,
                                                                 tmp_path: Path) -> None:
    engine = make_engine(db_url)
    files = RouteFiles(tmp_path / "routes") if store == "files" else None
    sm = make_sessionmaker(engine, files)
    writer = TraceWriter(sm, TraceSettings(batch_size=2, flush_interval_s=0.01),
                         route_files=files)
    writer.start()
    tid = f"r-{uuid.uuid4().hex[:8]}"
    t0 = [1, 2, 3, 10, 11]  # prompt [1, 2, 3], completion [10, 11]
    t1 = [*t0, 4, 5, 12, 13, 14]  # continued after the engine had forwarded up to 13
    t2 = [1, 2, 3, 10, 99, 7, 13, 14]  # cut at 4 (the harness re-rendered history)
    try:
        for rec in (
            _rec(tid, 0, 0, [1, 2, 3], [10, 11], [[0, _routes(t0, 0)]]),
            _rec(tid, 1, 5, [4, 5], [12, 13, 14],
                 [[4, _routes(t1, 4, 8)], [8, _routes(t1, 8)]]),
            # turn 2 asked from 0, under other weights: where it overlaps turn 0 (the
            # first 4 positions) the routes the tokens were first read under are kept
            _rec(tid, 2, 4, [99, 7], [13, 14], [[0, _routes(t2, 0, salt="v2|")]]),
        ):
            assert writer.submit(rec)
        assert await writer.drain(10)
        async with sm() as session, session.begin():
            await queries.finish_trajectory(session, trajectory_id=tid, group_id=None,
                                            reward=1.0, metadata=None, now=time.time())
        async with sm() as session:
            traj = await queries.get_trajectory(session, trajectory_id=tid)
            calls = await queries.get_calls(session, trajectory_id=tid)
        assert traj is not None
        row_bytes = SHAPE.num_layers * SHAPE.top_k  # uint8 ids: 16 experts
        assert [(c.routes_start, len(c.routes or b"")) for c in calls] == [
            (0, 128 + 4 * row_bytes), (4, 128 + 5 * row_bytes), (0, 128 + 7 * row_bytes)]
        sample = build_sample(traj, calls)
        assert sample.token_ids == t2
        assert sample.routed_experts is not None
        got = np.load(io.BytesIO(base64.b64decode(sample.routed_experts)))
        assert got.shape == (8, 3, 2) and got.dtype == np.int16
        # positions 0-3 from turn 0, the rest from turn 2 (turn 1's were cut)
        assert np.array_equal(got[:4], routed_experts(t0, 0, SHAPE)[:4])
        assert not np.array_equal(got[:4], routed_experts(t2, 0, SHAPE, "v2|")[:4])
        assert np.array_equal(got[4:-1], routed_experts(t2, 0, SHAPE, "v2|")[4:])
        assert (got[-1] == -1).all()

        async with sm() as session:  # where they lie: the rows, or a segment file
            rows = await queries.get_calls(session, trajectory_id=tid, routes=False)
        if files is None:
            assert all(c.routes_file is None for c in rows)
        else:
            assert [c.routes_length for c in rows] == [len(c.routes or b"") for c in calls]
            assert {c.routes_file for c in rows} == {p.name for p in files.root.iterdir()}
        out = tmp_path / "samples.parquet"
        assert await export_samples(db_url, out, fmt="parquet", progress=False,
                                    routes_dir=tmp_path / "routes") >= 1
        row = next(r for r in pq.read_table(out).to_pylist() if r["trajectory_id"] == tid)
        assert np.array_equal(np.load(io.BytesIO(row["routed_experts"])), got)
    finally:
        await writer.close()
        await engine.dispose()


def test_the_spool_carries_routes_as_the_engine_sent_them(tmp_path: Path) -> None:
    toks = [5, 6, 7, 8]
    rec = _rec("spooled", 0, 0, [5, 6], [7, 8], [[0, _routes(toks, 0)]])
    with Spool(tmp_path / "spool", 1 << 20) as spool:
        assert spool.append([rec]).kept == 1
        back, _ = spool.read(10)
    assert back[0].routes == rec.routes


def test_a_spool_written_before_routes_still_reads(tmp_path: Path) -> None:
    """A line a gateway without routes wrote (no ``routes`` key) is a record without them."""
    import dataclasses

    import orjson

    old = dataclasses.asdict(_rec("old", 0, 0, [1, 2], [3], None))
    del old["routes"]
    path = tmp_path / "spool"
    path.write_bytes(orjson.dumps(old) + b"\n")
    with Spool(path, 1 << 20) as spool:
        back, _ = spool.read(10)
    assert len(back) == 1 and back[0].routes is None and back[0].completion_ids == [3]


async def test_a_writer_behind_leaves_routes_out_and_keeps_the_tokens(sqlite_url: str) -> None:
    """Routes are ~50x a call's tokens: past ``routes_backlog`` records waiting, new
    records go in without them (counted), so a writer behind cannot fill memory with
    routes; every record's tokens are stored."""
    engine = make_engine(sqlite_url)
    writer = TraceWriter(make_sessionmaker(engine),
                         TraceSettings(routes_backlog=2, flush_interval_s=0.01))
    toks = [5, 6, 7, 8]
    records = [_rec(f"behind-{i}", 0, 0, [5, 6], [7, 8], [[0, _routes(toks, 0)]])
               for i in range(5)]
    try:
        for rec in records:  # not started: the records wait
            assert writer.submit(rec)
        assert writer.routes_dropped == 3
        assert [r.routes is not None for r in records] == [True, True, False, False, False]
        writer.start()
        assert await writer.drain(10) and writer.written == 5
        async with make_sessionmaker(engine)() as session:
            stored = {c.trajectory_id: c for r in records for c in
                      await queries.get_calls(session, trajectory_id=r.trajectory_id)}
        assert [stored[r.trajectory_id].routes is not None for r in records] == [
            True, True, False, False, False]
        assert all(stored[r.trajectory_id].completion_ids for r in records)
    finally:
        await writer.close()
        await engine.dispose()


async def test_routes_past_their_retention_are_cleared_and_the_tokens_kept(
        db_url: str) -> None:
    """A retention of 90 minutes. A trajectory idle for two hours loses its calls' routes,
    in batches, and keeps its tokens; one still running (calls two hours, one hour and a
    moment ago) keeps every call's routes, its oldest included, until it has been idle as
    long."""
    from datetime import UTC, datetime

    from gateway.store.retention import RoutesRetention, drop_routes_before

    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    writer = TraceWriter(sm, TraceSettings(batch_size=10, flush_interval_s=0.01))
    writer.start()
    tag = uuid.uuid4().hex[:8]
    now = time.time()
    t0 = [1, 2, 3, 10, 11]
    t1 = [*t0, 4, 12, 13]
    t2 = [*t1, 5, 14, 15]

    def three_calls(tid: str, ages_h: tuple[float, ...]) -> list[CallRecord]:
        recs = []
        for seq, (offset, delta, completion, toks) in enumerate(
                [(0, [1, 2, 3], [10, 11], t0), (5, [4], [12, 13], t1),
                 (8, [5], [14, 15], t2)][:len(ages_h)]):
            rec = _rec(tid, seq, offset, delta, completion, [[offset, _routes(toks, offset)]])
            rec.started_at = now - 3600 * ages_h[seq]
            recs.append(rec)
        return recs

    running, idle = f"run-{tag}", f"idle-{tag}"
    try:
        for rec in [*three_calls(running, (2, 1, 0)), *three_calls(idle, (3, 2.5, 2))]:
            assert writer.submit(rec)
        assert await writer.drain(10)
        async with sm() as session:
            before = {t: build_sample(await queries.get_trajectory(session, trajectory_id=t),
                                      await queries.get_calls(session, trajectory_id=t))
                      for t in (running, idle)}
        async with sm() as session, session.begin():  # a batch at a time
            cutoff = datetime.fromtimestamp(now - 5400, tz=UTC)
            assert await drop_routes_before(session, cutoff=cutoff, limit=2) == 2
        retention = RoutesRetention(sm, 5400, clock=lambda: now)
        # the idle one's rest (and any other test's old enough: the Postgres database is
        # the session's)
        assert await retention.step() >= 1 and retention.dropped >= 1
        assert await retention.step() == 0

        async with sm() as session:
            calls = {t: await queries.get_calls(session, trajectory_id=t)
                     for t in (running, idle)}
            after = {t: build_sample(await queries.get_trajectory(session, trajectory_id=t),
                                     calls[t]) for t in (running, idle)}
        assert [c.routes is None for c in calls[idle]] == [True, True, True]
        assert [c.routes_start for c in calls[idle]] == [None, None, None]
        assert [c.routes is None for c in calls[running]] == [False, False, False]
        assert after[idle].routed_experts is None and before[idle].routed_experts is not None
        assert after[running].routed_experts == before[running].routed_experts
        for t in (running, idle):
            assert after[t].token_ids == before[t].token_ids == t2
            assert after[t].loss_mask == before[t].loss_mask
            assert after[t].logprobs == before[t].logprobs
        # an hour later the running one has been idle for longer than the retention too
        later = RoutesRetention(sm, 5400, clock=lambda: now + 5401)
        assert await later.step() >= 3
        async with sm() as session:
            gone = await queries.get_calls(session, trajectory_id=running)
        assert [c.routes is None for c in gone] == [True, True, True]
    finally:
        await writer.close()
        await engine.dispose()


async def test_segments_past_the_retention_are_deleted_and_running_trajectories_keep_theirs(
        db_url: str, tmp_path: Path) -> None:
    """Routes in segment files go a whole segment at a time, once it holds only what is
    older than the retention (90 minutes): a trajectory idle since loses its routes, its
    tokens kept; one still running (a call since) keeps every call's routes, copied into a
    current segment first; the old file is deleted. Later the running one goes too."""
    from gateway.store.retention import RoutesRetention

    engine = make_engine(db_url)
    clock = [time.time()]
    now = clock[0]
    files = RouteFiles(tmp_path / "routes", segment_age_s=60, clock=lambda: clock[0])
    sm = make_sessionmaker(engine, files)
    writer = TraceWriter(sm, TraceSettings(batch_size=10, flush_interval_s=0.01),
                         route_files=files)
    writer.start()
    tag = uuid.uuid4().hex[:8]
    running, idle = f"run-{tag}", f"idle-{tag}"
    t0, t1 = [1, 2, 3, 10, 11], [1, 2, 3, 10, 11, 4, 12, 13]

    def call(tid: str, seq: int, started: float) -> CallRecord:
        offset, delta, completion, toks = [(0, [1, 2, 3], [10, 11], t0),
                                           (5, [4], [12, 13], t1)][seq]
        rec = _rec(tid, seq, offset, delta, completion, [[offset, _routes(toks, offset)]])
        rec.started_at = started
        return rec

    async def samples() -> dict[str, Any]:
        async with sm() as session:
            return {t: build_sample(await queries.get_trajectory(session, trajectory_id=t),
                                    await queries.get_calls(session, trajectory_id=t))
                    for t in (running, idle)}

    try:
        for rec in (call(running, 0, now - 60), call(idle, 0, now - 60), call(idle, 1, now)):
            assert writer.submit(rec)
        assert await writer.drain(10)
        first = {p.name for p in files.root.iterdir()}
        assert len(first) == 1
        clock[0] = now + 5000  # the running trajectory's next call, into a new segment
        assert writer.submit(call(running, 1, now + 5000))
        assert await writer.drain(10)
        before = await samples()
        assert all(s.routed_experts is not None for s in before.values())

        retention = RoutesRetention(sm, 5400, files=files, clock=lambda: now + 5461)
        clock[0] = now + 5461
        # the idle one's two calls (and on Postgres, the session's database, other tests'
        # rows that old)
        assert await retention.step() >= 2
        assert retention.segments_deleted == 1 and not first & {
            p.name for p in files.root.iterdir()}
        after = await samples()
        assert after[idle].routed_experts is None
        assert after[running].routed_experts == before[running].routed_experts
        for t in (running, idle):
            assert after[t].token_ids == before[t].token_ids
            assert after[t].loss_mask == before[t].loss_mask
        clock[0] = now + 20_000  # idle since long enough: the running one goes too
        later = RoutesRetention(sm, 5400, files=files, clock=lambda: now + 20_000)
        assert await later.step() >= 2
        assert list(files.root.iterdir()) == []
        assert (await samples())[running].routed_experts is None
    finally:
        await writer.close()
        await engine.dispose()
