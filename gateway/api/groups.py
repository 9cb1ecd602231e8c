"""Group API: wait for a GRPO group to finish and answer all its samples in one response.

``GET /groups/{group_id}/samples?count=N&timeout_s=T`` (or ``/trees``, each trajectory
as one prefix tree: :mod:`gateway.store.trees`) holds the request (a bounded long
poll) until ``N`` trajectories of the group are finished, then answers the samples of
every finished trajectory of the group, each trajectory's branches together (as
``GET /trajectories/{id}/samples`` gives them). A trainer thus makes one request per
group instead of one list poll per interval and one sample request per trajectory. When
``T`` seconds pass first the answer is 408 with how many had finished; the client asks
again until its own deadline. Without ``count`` it answers at once with what is finished.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse

from gateway.api.deps import get_rt, require_trainer
from gateway.api.sampling import CURRENT, MAX_STALENESS, MODEL, versus
from gateway.errors import Conflict
from gateway.runtime import Runtime
from gateway.schema.samples import GroupSamples, GroupTrees, Sample, SampleTree
from gateway.store import queries
from gateway.store.samples import build_samples, has_calls_for
from gateway.store.trees import build_tree
from gateway.trajectories.tagging import validate_id

router = APIRouter(prefix="/groups", tags=["groups"], dependencies=[Depends(require_trainer)])
DRAIN_TIMEOUT_S = 5.0
POLL_S = 0.1  # how often a waiting request looks at the store
MAX_COUNT = 10_000  # trajectories one answer may wait for
MAX_WAIT_S = 600.0

_TIMEOUT_DOC = {"description": "``count`` trajectories were not finished within "
                "``timeout_s``: ``{detail, group_id, count, finished, trajectory_ids}`` "
                "(the ids of those finished)"}


async def _finished(rt: Runtime, group_id: str) -> list[str]:
    await rt.writer.drain(DRAIN_TIMEOUT_S)
    async with rt.sessionmaker() as session:
        return await queries.finished_trajectory_ids(session, group_id=group_id,
                                                     limit=MAX_COUNT)


async def _group_samples(rt: Runtime, ids: list[str], *, branches: str,
                         current_version: str, model: str | None
                         ) -> tuple[list[str], list[Sample]]:
    """The trajectory ids by creation time, and the samples of their latest attempts in
    that order, each one's branches together (the writer was drained just before)."""
    out: list[tuple[Any, str, list[Sample]]] = []
    async with rt.sessionmaker() as session:
        for tid in ids:
            traj = await queries.get_trajectory(session, trajectory_id=tid)
            if traj is None:
                continue
            calls = await queries.get_calls(session, trajectory_id=tid, attempt=traj.attempt)
            if not has_calls_for(calls, model):
                continue  # no call for this policy: no sample of it
            built = build_samples(traj, calls, branches=branches,
                                  current_version=current_version, model=model)
            out.append((traj.created_at, tid, built))
    out.sort(key=lambda row: (row[0], row[1]))
    return [tid for _, tid, _ in out], [s for _, _, built in out for s in built]


_COUNT = Query(None, ge=1, le=MAX_COUNT, description="wait until this many of the group's "
               "trajectories are finished (default: answer at once with those finished)")
_TIMEOUT = Query(30.0, ge=0, le=MAX_WAIT_S, description="how long to wait; then 408 with "
                 "how many were finished")


async def _wait(rt: Runtime, group_id: str, count: int | None,
                timeout_s: float) -> list[str] | JSONResponse:
    """The ids of the group's finished trajectories once ``count`` are, or the 408."""
    validate_id(group_id, what="group_id")
    deadline = time.monotonic() + timeout_s
    while len(ids := await _finished(rt, group_id)) < (count or 0):
        if time.monotonic() >= deadline:
            return JSONResponse(status_code=408, content={
                "detail": f"group {group_id!r}: {len(ids)} of {count} trajectories "
                          f"finished after {timeout_s:g} s",
                "group_id": group_id, "count": count, "finished": len(ids),
                "trajectory_ids": ids})
        await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    return ids


def _check_staleness(group_id: str, stale: int, bound: int | None) -> None:
    if bound is not None and stale > bound:
        raise Conflict(f"group {group_id!r} is {stale} versions stale (bound {bound})",
                       param="max_staleness")


@router.get("/{group_id}/samples", summary="Wait until a group has `count` finished "
            "trajectories, then every branch of each as a training sample",
            response_model=GroupSamples, responses={408: _TIMEOUT_DOC})
async def group_samples(
    group_id: str,
    count: int | None = _COUNT,
    timeout_s: float = _TIMEOUT,
    branches: Literal["all", "main", "longest"] = Query(
        "all", description="all branches, the main one, or the one with the most "
        "generated tokens (docs/token-capture.md)"),
    max_staleness: int | None = MAX_STALENESS,
    current_version: str | None = CURRENT,
    model: str | None = MODEL,
    rt: Runtime = Depends(get_rt),
) -> GroupSamples | JSONResponse:  # the 408 is sent as is
    ids = await _wait(rt, group_id, count, timeout_s)
    if isinstance(ids, JSONResponse):
        return ids
    ordered, built = await _group_samples(
        rt, ids, branches=branches, current_version=versus(rt, current_version, model),
        model=model)
    _check_staleness(group_id, max((s.max_staleness or 0 for s in built), default=0),
                     max_staleness)
    return GroupSamples(group_id=group_id, finished=len(ordered), trajectory_ids=ordered,
                        data=built)


@router.get("/{group_id}/trees", summary="Wait until a group has `count` finished "
            "trajectories, then each as a prefix tree (each token once)",
            response_model=GroupTrees, responses={408: _TIMEOUT_DOC})
async def group_trees(
    group_id: str,
    count: int | None = _COUNT,
    timeout_s: float = _TIMEOUT,
    max_staleness: int | None = MAX_STALENESS,
    current_version: str | None = CURRENT,
    model: str | None = MODEL,
    rt: Runtime = Depends(get_rt),
) -> GroupTrees | JSONResponse:
    ids = await _wait(rt, group_id, count, timeout_s)
    if isinstance(ids, JSONResponse):
        return ids
    rows: list[tuple[Any, SampleTree]] = []
    async with rt.sessionmaker() as session:
        for tid in ids:
            traj = await queries.get_trajectory(session, trajectory_id=tid)
            if traj is None:
                continue
            calls = await queries.get_calls(session, trajectory_id=tid, attempt=traj.attempt)
            if not has_calls_for(calls, model):
                continue  # no call for this policy
            rows.append((traj.created_at, build_tree(
                traj, calls, current_version=versus(rt, current_version, model),
                model=model)))
    rows.sort(key=lambda row: (row[0], row[1].trajectory_id))
    trees = [t for _, t in rows]
    _check_staleness(group_id, max((t.max_staleness or 0 for t in trees), default=0),
                     max_staleness)
    return GroupTrees(group_id=group_id, finished=len(trees),
                      trajectory_ids=[t.trajectory_id for t in trees], data=trees)
