"""Export finished trajectories as training samples (JSON lines or Parquet)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pyarrow.parquet as pq
from rich.progress import Progress
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.schema.table import SAMPLE_SCHEMA, sample_record, samples_table
from gateway.store import queries
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.samples import Sample, build_samples

__all__ = ["SAMPLE_SCHEMA", "export_samples", "iter_samples", "sample_record", "samples_table"]

async def iter_samples(
    sessionmaker: async_sessionmaker[AsyncSession], ids: list[str], branches: str = "all"
) -> AsyncIterator[Sample]:
    """The samples of ``ids`` (latest attempt), each trajectory's ``branches``."""
    for trajectory_id in ids:
        async with sessionmaker() as session:
            traj = await queries.get_trajectory(session, trajectory_id=trajectory_id)
            if traj is None:
                continue
            calls = await queries.get_calls(session, trajectory_id=trajectory_id,
                                            attempt=traj.attempt)
        for sample in build_samples(traj, calls, branches=branches):
            yield sample


async def export_samples(
    url: str, out: Path, *, fmt: str, group_id: str | None = None, progress: bool = True,
    branches: str = "all",
) -> int:
    """Write every finished trajectory (optionally of one group) to ``out``, a row per
    branch (``branches``: all, main or longest); the number of trajectories written."""
    engine = make_engine(url)
    try:
        sm = make_sessionmaker(engine)
        async with sm() as session:
            ids = await queries.finished_trajectory_ids(session, group_id=group_id)
        samples: list[Sample] = []
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("exporting", total=len(ids))
            with out.open("wb") if fmt == "jsonl" else _null() as fh:
                seen: str | None = None
                async for s in iter_samples(sm, ids, branches):
                    if fh is not None:
                        fh.write(orjson.dumps(sample_record(s)) + b"\n")
                    else:
                        samples.append(s)
                    if s.trajectory_id != seen:
                        seen = s.trajectory_id
                        bar.advance(task)
        if fmt == "parquet":
            pq.write_table(samples_table(samples), out)
        return len(ids)
    finally:
        await engine.dispose()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
