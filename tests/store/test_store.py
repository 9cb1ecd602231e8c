"""Trace store on real databases (SQLite file and Postgres): writer, samples, export."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq

from gateway.config import TraceSettings
from gateway.store import queries
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.export import export_samples
from gateway.store.records import CallRecord
from gateway.store.samples import build_sample
from gateway.store.writer import TraceWriter


def _rec(traj: str, seq: int, offset: int, delta: list[int], completion: list[int],
         mismatch: int | None = None, version: str = "v1") -> CallRecord:
    return CallRecord(
        id=f"{traj}-{seq}", trajectory_id=traj, group_id="g1", seq=seq, endpoint="chat",
        model="m", weight_version=version, started_at=time.time() + seq, prompt_offset=offset,
        prompt_delta=delta, prompt_len=offset + len(delta), completion_ids=completion,
        completion_logprobs=[-0.25] * len(completion), mismatch_pos=mismatch, tp=2,
    )


async def test_writer_batches_and_samples_rebuild_the_sequence(db_url: str, tmp_path: Path):
    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    writer = TraceWriter(sm, TraceSettings(batch_size=2, flush_interval_s=0.01))
    writer.start()
    tid = f"t1-{uuid.uuid4().hex[:8]}"
    try:
        # turn 0: prompt [1,2,3] -> [10,11]; turn 1 extends; turn 2 diverges at position 4.
        for rec in (_rec(tid, 0, 0, [1, 2, 3], [10, 11]),
                    _rec(tid, 1, 5, [4, 5], [12], version="v2"),
                    _rec(tid, 2, 4, [99, 7], [13, 14], mismatch=4, version="v2")):
            assert writer.submit(rec)
        assert await writer.drain(10)
        assert writer.written == 3 and writer.dropped == 0
        async with sm() as session, session.begin():
            await queries.finish_trajectory(session, trajectory_id=tid, group_id=None,
                                            reward=1.5, metadata={"k": 1}, now=time.time())
        async with sm() as session:
            traj = await queries.get_trajectory(session, trajectory_id=tid)
            calls = await queries.get_calls(session, trajectory_id=tid)
        assert traj is not None and traj.reward == 1.5 and traj.group_id == "g1"
        sample = build_sample(traj, calls)
        # [1,2,3]+[10,11] -> +[4,5]+[12] -> cut to 4 tokens, +[99,7]+[13,14]
        assert sample.token_ids == [1, 2, 3, 10, 99, 7, 13, 14]
        assert sample.loss_mask == [0, 0, 0, 1, 0, 0, 1, 1]
        assert sample.logprobs == [0, 0, 0, -0.25, 0, 0, -0.25, -0.25]
        assert [(m.seq, m.position) for m in sample.mismatches] == [(2, 4)]
        assert sample.weight_versions[-1] == "v2" and sample.weight_versions[3] == "v1"

        out = tmp_path / "samples.parquet"
        assert await export_samples(db_url, out, fmt="parquet", progress=False, group_id="g1") >= 1
        table = pq.read_table(out).to_pylist()
        row = next(r for r in table if r["trajectory_id"] == tid)
        assert row["token_ids"] == sample.token_ids
        assert row["reward"] == 1.5
    finally:
        await writer.close()
        await engine.dispose()


async def test_writer_counts_drops_when_its_queue_is_full(sqlite_url: str):
    engine = make_engine(sqlite_url)
    writer = TraceWriter(make_sessionmaker(engine), TraceSettings(queue_size=2,
                                                                  overflow_size=1))
    try:  # not started: nothing drains the queue
        results = [writer.submit(_rec("t2", i, 0, [1], [2])) for i in range(4)]
        assert results == [True, True, True, False] and writer.dropped == 1
        assert writer.lost == {"memory_full": 1} and writer.memory_full
    finally:
        await engine.dispose()


async def test_a_batch_written_twice_is_stored_once(db_url: str):
    """A retried batch whose first commit did land (ack lost) must not be rejected."""
    from sqlalchemy import func, select

    from gateway.store.models import Call
    from gateway.store.writer import write_batch

    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    tid = f"dup-{uuid.uuid4().hex[:8]}"
    # more rows than the writer encodes between event-loop turns (_ROWS_PER_TURN)
    recs = [_rec(tid, i, 0, [1, 2], [3]) for i in range(100)]
    try:
        async with sm() as session, session.begin():
            await write_batch(session, recs[:70])
        async with sm() as session, session.begin():
            await write_batch(session, recs)  # 70 already stored, 30 new
        async with sm() as session:
            n = await session.scalar(select(func.count()).select_from(Call).where(
                Call.trajectory_id == tid))
        assert n == 100
    finally:
        await engine.dispose()


async def test_drain_waits_for_what_was_submitted_not_for_an_idle_writer(sqlite_url: str):
    """Under a steady stream of records the writer is never idle; a reader (``GET
    /trajectories/{id}``) that drains must still get its records at once."""
    engine = make_engine(sqlite_url)
    sm = make_sessionmaker(engine)
    writer = TraceWriter(sm, TraceSettings(flush_interval_s=0.02))
    writer.start()
    stop = asyncio.Event()

    async def steady() -> None:
        i = 0
        while not stop.is_set():
            writer.submit(_rec(f"bg-{i}", 0, 0, [1], [2]))
            i += 1
            await asyncio.sleep(0.001)

    feeder = asyncio.create_task(steady())
    try:
        await asyncio.sleep(0.2)
        assert writer.submit(_rec("mine", 0, 0, [1, 2], [3]))
        started = time.monotonic()
        assert await writer.drain(5)
        waited = time.monotonic() - started
        async with sm() as session:
            assert [c.seq for c in await queries.get_calls(session, trajectory_id="mine")] == [0]
        assert waited < 2, waited  # the old idle wait ran to the 5 s timeout here
    finally:
        stop.set()
        await feeder
        await writer.close()
        await engine.dispose()


async def test_export_as_trees_holds_each_token_once(db_url: str, tmp_path: Path):
    """``export --branches tree``: a row per trajectory; each branch's sequence is a path
    of its tree and the tree's loss mask holds every generated token once."""
    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    writer = TraceWriter(sm, TraceSettings(flush_interval_s=0.01))
    writer.start()
    tid, group = f"tree-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:6]}"
    try:
        side = _rec(tid, 1, 1, [7], [20, 21])  # a side call forked after one token
        side.branch, side.parent_branch, side.group_id = 1, 0, group
        side.model = "verifier"  # another policy's call (docs/weight-updates.md)
        for rec in (_rec(tid, 0, 0, [1, 2, 3], [10, 11]), side,
                    _rec(tid, 2, 5, [4, 5], [12, 13])):
            rec.group_id = group
            assert writer.submit(rec)
        assert await writer.drain(10)
        async with sm() as session, session.begin():
            await queries.finish_trajectory(session, trajectory_id=tid, group_id=group,
                                            reward=1.0, metadata=None, now=time.time())
        out = tmp_path / "trees.parquet"
        assert await export_samples(db_url, out, fmt="parquet", progress=False,
                                    group_id=group, branches="tree") == 1
        [row] = pq.read_table(out).to_pylist()
        assert row["token_ids"] == [1, 2, 3, 10, 11, 4, 5, 12, 13, 7, 20, 21]
        assert row["parents"] == [-1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10]
        assert row["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 1, 1]
        assert row["branches"] == [0, 1] and row["branch_leaves"] == [8, 11]
        assert row["main_branch"] == 0 and row["reward"] == 1.0
        # one policy's: its branches only, whole, its tokens alone trained
        assert await export_samples(db_url, out, fmt="parquet", progress=False,
                                    group_id=group, branches="tree", model="verifier") == 1
        [row] = pq.read_table(out).to_pylist()
        assert (row["token_ids"], row["loss_mask"]) == ([1, 7, 20, 21], [0, 0, 1, 1])
        assert row["branches"] == [1] and row["main_branch"] == 1
        assert await export_samples(db_url, out, fmt="parquet", progress=False,
                                    group_id=group, model="m") == 1
        [row] = pq.read_table(out).to_pylist()
        assert row["token_ids"] == [1, 2, 3, 10, 11, 4, 5, 12, 13]
        assert row["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1, 1]
        assert await export_samples(db_url, out, fmt="parquet", progress=False,
                                    group_id=group, model="critic") == 0
    finally:
        await writer.close()
        await engine.dispose()
