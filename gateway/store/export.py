"""Export finished trajectories as training samples (JSON lines or Parquet)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from rich.progress import Progress
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.schema.samples import SampleTree
from gateway.schema.table import (
    SAMPLE_SCHEMA,
    TREE_SCHEMA,
    sample_record,
    samples_table,
    tree_record,
)
from gateway.store import queries
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.route_files import RouteFiles, default_routes_dir
from gateway.store.samples import Sample, build_samples, has_calls_for
from gateway.store.trees import build_tree

__all__ = ["SAMPLE_SCHEMA", "TREE_SCHEMA", "export_samples", "iter_samples", "iter_trees",
           "sample_record", "samples_table", "tree_record"]

async def iter_samples(
    sessionmaker: async_sessionmaker[AsyncSession], ids: list[str], branches: str = "all",
    model: str | None = None,
) -> AsyncIterator[Sample]:
    """The samples of ``ids`` (latest attempt), each trajectory's ``branches``; with
    ``model``, that policy's (trajectories without a call for it give none)."""
    for trajectory_id in ids:
        async with sessionmaker() as session:
            traj = await queries.get_trajectory(session, trajectory_id=trajectory_id)
            if traj is None:
                continue
            calls = await queries.get_calls(session, trajectory_id=trajectory_id,
                                            attempt=traj.attempt)
        if not has_calls_for(calls, model):
            continue
        for sample in build_samples(traj, calls, branches=branches, model=model):
            yield sample


async def iter_trees(sessionmaker: async_sessionmaker[AsyncSession], ids: list[str],
                     model: str | None = None) -> AsyncIterator[SampleTree]:
    """``ids`` (latest attempt) as prefix trees (:mod:`gateway.store.trees`); ``model``
    as in :func:`iter_samples`."""
    for trajectory_id in ids:
        async with sessionmaker() as session:
            traj = await queries.get_trajectory(session, trajectory_id=trajectory_id)
            if traj is None:
                continue
            calls = await queries.get_calls(session, trajectory_id=trajectory_id,
                                            attempt=traj.attempt)
        if has_calls_for(calls, model):
            yield build_tree(traj, calls, model=model)


async def export_samples(
    url: str, out: Path, *, fmt: str, group_id: str | None = None, progress: bool = True,
    branches: str = "all", model: str | None = None, routes_dir: Path | None = None,
) -> int:
    """Write every finished trajectory (optionally of one group) to ``out``, a row per
    branch (``branches``: all, main or longest), or a row per trajectory as its prefix
    tree (``tree``); ``model``: one policy's samples (``build_branches``); routed experts
    in segment files read from ``routes_dir`` (default: the store's own,
    :func:`default_routes_dir`). The number of trajectories written."""
    engine = make_engine(url)
    try:
        sm = make_sessionmaker(engine, RouteFiles(routes_dir or default_routes_dir(url)))
        async with sm() as session:
            ids = await queries.finished_trajectory_ids(session, group_id=group_id)
        rows: list[dict[str, Any]] = []
        trees = branches == "tree"
        items = iter_trees(sm, ids, model) if trees else iter_samples(sm, ids, branches,
                                                                       model)
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("exporting", total=len(ids))
            with out.open("wb") if fmt == "jsonl" else _null() as fh:
                seen: str | None = None
                written = 0
                async for item in items:
                    row = tree_record(item) if isinstance(item, SampleTree) else \
                        sample_record(item)
                    if fh is not None:
                        fh.write(orjson.dumps(row) + b"\n")
                    else:
                        rows.append(row)
                    if item.trajectory_id != seen:
                        seen, written = item.trajectory_id, written + 1
                        bar.advance(task)
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(rows, schema=TREE_SCHEMA if trees
                                                else SAMPLE_SCHEMA), out)
        return written
    finally:
        await engine.dispose()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
