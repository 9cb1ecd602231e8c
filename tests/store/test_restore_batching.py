"""The restore lookup at a batch start: the first calls of many new trajectories cost one
existence query together, and an id the store knows is still restored. (When the store
cannot answer, the calls are refused, never started as new: tests/store/test_restore_faults.py.)"""

from __future__ import annotations

import asyncio

from gateway.config import RestoreSettings
from gateway.store import queries
from gateway.store.db import make_engine, make_sessionmaker
from gateway.trajectories.restore import Restorer
from gateway.trajectories.tracker import Tracker


async def test_a_burst_of_new_ids_is_one_existence_query(db_url: str) -> None:
    engine = make_engine(db_url)
    sessionmaker = make_sessionmaker(engine)
    try:
        async with sessionmaker() as session, session.begin():
            await queries.finish_trajectory(session, trajectory_id="seen-before",
                                            group_id="g", reward=1.0, metadata=None, now=1.0)
        tracker = Tracker()
        restorer = Restorer(tracker, sessionmaker, settings=RestoreSettings(batch_window_s=0.01))
        new = [f"fresh-{i}" for i in range(64)]
        got = await asyncio.gather(*(restorer.restore(t) for t in [*new, "seen-before"]))
        assert got[:-1] == [None] * len(new)  # unknown to the store: they start fresh
        old = got[-1]
        assert old is not None and old.id == "seen-before" and old.finished_at is not None
        assert restorer.existence_queries == 1 and restorer.restored == 1
        assert restorer.failures == 0
        # an id asked again while unknown is asked again (a later batch), never cached as new
        assert await restorer.restore("fresh-0") is None
        assert restorer.existence_queries == 2
    finally:
        await engine.dispose()


async def test_ids_arriving_while_a_query_runs_are_asked_next(sqlite_url: str) -> None:
    """The hang this guards against: an id that came while the existence query was in
    flight waited for a batch that was never sent."""
    engine = make_engine(sqlite_url)
    try:
        restorer = Restorer(Tracker(), make_sessionmaker(engine),
                            settings=RestoreSettings(batch_window_s=0.0))
        tasks = []
        for i in range(40):
            tasks.append(asyncio.create_task(restorer.restore(f"staggered-{i}")))
            await asyncio.sleep(0.0005)
        got = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        assert got == [None] * 40 and restorer.failures == 0
        assert 2 <= restorer.existence_queries < 40  # several batches, not one per id
    finally:
        await engine.dispose()
