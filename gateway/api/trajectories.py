"""Trajectory API: list, inspect, finish with a reward, fetch the training sample, mint a
harness key for one trajectory. Trainer role (the trainer or admin token, see
:mod:`gateway.api.deps`); prompt and completion text need the admin token."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.api.deps import get_access, get_rt, is_admin, require_trainer
from gateway.api.sampling import CURRENT, MAX_STALENESS, MODEL, versus
from gateway.errors import Conflict, Forbidden, NotFound
from gateway.runtime import Runtime
from gateway.schema.samples import Sample, SampleList, SampleTree
from gateway.schema.trajectories import (
    CallTrace,
    FinishedTrajectory,
    HarnessKey,
    LiveView,
    TrajectoryDetail,
    TrajectoryInfo,
    TrajectoryPage,
    Usage,
)
from gateway.store import queries
from gateway.store.codec import unpack_floats, unpack_ids
from gateway.store.models import Call, Trajectory, TrajectoryAttempt
from gateway.store.samples import build_samples, has_calls_for
from gateway.store.trees import build_tree
from gateway.trajectories.tagging import validate_id
from gateway.weights.aborts import abort_trajectory

router = APIRouter(prefix="/trajectories", tags=["trajectories"],
                   dependencies=[Depends(require_trainer)])
DRAIN_TIMEOUT_S = 5.0
METADATA_DEPTH = 32


def finite_json(value: object, where: str = "metadata", depth: int = 0) -> None:
    """Raise unless ``value`` is JSON every store and exporter can hold: no NaN or infinity
    (``1e400`` parses to infinity), nested at most ``METADATA_DEPTH`` deep."""
    if depth > METADATA_DEPTH:
        raise ValueError(f"{where} is nested deeper than {METADATA_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} holds {value!r}: only finite numbers are accepted")
    if isinstance(value, dict):
        for k, v in value.items():
            finite_json(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            finite_json(v, f"{where}[{i}]", depth + 1)


class FinishRequest(BaseModel):
    # NaN, Infinity and 1e400 (infinity once parsed) are 422: a reward is a real number
    model_config = ConfigDict(allow_inf_nan=False)

    reward: float | None = None
    #: each policy's own reward by model name, for a trajectory whose calls were of
    #: several (a solver and a verifier): ``?model=`` samples of one carry its own
    rewards: dict[str, float] | None = Field(None, max_length=64)
    metadata: dict[str, Any] | None = None
    group_id: str | None = Field(None, max_length=128)

    @field_validator("rewards")
    @classmethod
    def _names(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and any(not 1 <= len(k) <= 256 for k in value):
            raise ValueError("a rewards key is a model name: 1-256 characters")
        return value

    @field_validator("metadata")
    @classmethod
    def _finite(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        finite_json(value)
        return value


class AbortRequest(BaseModel):
    reason: str = Field("aborted by the trainer", min_length=1, max_length=500)


class KeyRequest(BaseModel):
    group_id: str | None = Field(None, max_length=128, description="bind the key to this "
                                 "GRPO group too; without one its calls have no group. "
                                 "Either way a call naming another group is 403")


def live_view(rt: Runtime, trajectory_id: str) -> LiveView | None:
    st = rt.tracker.get(trajectory_id)
    if st is None:
        return None
    return LiveView(phase=st.phase.value, attempt=st.attempt, turns=st.turns,
                    in_flight=st.in_flight, queued=st.queued,
                    context_tokens=st.context_tokens, llm_time_s=round(st.llm_time_s, 4),
                    tool_time_s=round(st.tool_time_s, 4),
                    queue_time_s=round(st.queue_time_s, 4), mismatches=st.mismatches,
                    backend_id=st.backend_id)


def _call_trace(call: Call, *, text: bool) -> CallTrace:
    """The call as stored; its text only when asked (the route leaves unset fields out,
    so without ``include_text`` the two keys are absent, not null)."""
    extra = {"request_messages": call.request_messages,
             "completion_text": call.completion_text} if text else {}
    return CallTrace(
        id=call.id, attempt=call.attempt, seq=call.seq, endpoint=call.endpoint,
        model=call.model, status=call.status, error=call.error,
        finish_reason=call.finish_reason, backend_id=call.backend_id, tp=call.tp,
        weight_version=call.weight_version, weight_segments=call.weight_segments,
        started_at=call.started_at, queued_ms=call.queued_ms, ttft_ms=call.ttft_ms,
        total_ms=call.total_ms, prompt_len=call.prompt_len,
        prompt_offset=call.prompt_offset, mismatch_pos=call.mismatch_pos,
        branch=call.branch, parent_branch=call.parent_branch, kept_len=call.kept_len,
        requested_model=call.requested_model, constrained=call.constrained,
        prompt_delta_ids=unpack_ids(call.prompt_delta),
        completion_ids=unpack_ids(call.completion_ids),
        completion_logprobs=unpack_floats(call.completion_logprobs),
        usage=Usage(prompt_tokens=call.prompt_tokens,
                    completion_tokens=call.completion_tokens),
        extra_choices=call.extra_choices, **extra)


def _want_text(request: Request, include_text: bool) -> bool:
    if include_text and not is_admin(request):
        raise Forbidden("include_text=true needs the admin token (ROLLOUT_GATEWAY_ADMIN_TOKEN)",
                        param="include_text")
    return include_text


@router.get("", summary="List or search trajectories")
async def list_trajectories(
    group_id: str | None = Query(None, max_length=128),
    finished: bool | None = None,
    q: str | None = Query(None, max_length=128, description="the id contains this "
                          "(case-insensitive)"),
    min_reward: float | None = Query(None, allow_inf_nan=False),
    max_reward: float | None = Query(None, allow_inf_nan=False),
    min_tokens: int | None = Query(None, ge=0, le=2**62, description="completion tokens "
                                   "over its calls, at least"),
    max_tokens: int | None = Query(None, ge=0, le=2**62),
    weight_version: str | None = Query(None, max_length=128, description="a call of it "
                                       "ran on this weight version"),
    model: str | None = Query(None, max_length=256, description="a call of it was "
                              "recorded under this model (a policy; after aliases)"),
    order: queries.Order = Query("created", description="-x: descending"),
    limit: int = Query(100, ge=1, le=10_000),
    offset: int = Query(0, ge=0, le=2**31 - 1),
    rt: Runtime = Depends(get_rt),
) -> TrajectoryPage:
    where = queries.TrajectoryFilter(
        group_id=group_id, finished=finished, id_contains=q, min_reward=min_reward,
        max_reward=max_reward, min_tokens=min_tokens, max_tokens=max_tokens,
        weight_version=weight_version, model=model, order=order)
    await rt.writer.drain(DRAIN_TIMEOUT_S)
    async with rt.sessionmaker() as session:
        rows = await queries.list_trajectories(session, where=where, limit=limit,
                                               offset=offset)
    data = [TrajectoryInfo(
        id=r.trajectory.id, group_id=r.trajectory.group_id,
        created_at=r.trajectory.created_at, finished_at=r.trajectory.finished_at,
        reward=r.trajectory.reward, calls=r.calls, completion_tokens=r.completion_tokens,
        live=live_view(rt, r.trajectory.id),
    ) for r in rows]
    return TrajectoryPage(data=data, limit=limit, offset=offset)


async def _load(rt: Runtime, trajectory_id: str, attempt: int | None = None,
                *, every_attempt: bool = False, routes: bool = True
                ) -> tuple[Trajectory, Sequence[Call]]:
    """The stored trajectory and its calls (of ``attempt``, default the latest, or of
    every attempt; their routed experts unread without ``routes``), after the writer
    flushed what it holds."""
    validate_id(trajectory_id)
    await rt.writer.drain(DRAIN_TIMEOUT_S)
    async with rt.sessionmaker() as session:
        traj = await queries.get_trajectory(session, trajectory_id=trajectory_id)
        if traj is None:
            raise NotFound(f"no trajectory {trajectory_id!r}")
        if attempt is not None and attempt > traj.attempt:
            raise NotFound(f"trajectory {trajectory_id!r} has no attempt {attempt} "
                           f"(latest is {traj.attempt})")
        which = None if every_attempt else (traj.attempt if attempt is None else attempt)
        calls = await queries.get_calls(session, trajectory_id=trajectory_id, attempt=which,
                                        routes=routes)
    return traj, calls


@router.get("/{trajectory_id}", summary="One trajectory with its calls' token traces",
            response_model_exclude_unset=True)
async def get_trajectory(
    request: Request, trajectory_id: str, include_text: bool = False,
    rt: Runtime = Depends(get_rt),
) -> TrajectoryDetail:
    text = _want_text(request, include_text)
    traj, calls = await _load(rt, trajectory_id, every_attempt=True, routes=False)
    return TrajectoryDetail(
        id=traj.id, attempt=traj.attempt, group_id=traj.group_id,
        created_at=traj.created_at, finished_at=traj.finished_at, reward=traj.reward,
        rewards=traj.rewards, metadata=traj.meta, live=live_view(rt, traj.id),
        calls=[_call_trace(c, text=text) for c in calls])


@router.post("/{trajectory_id}/finish", summary="Finish a trajectory with its reward")
async def finish(
    trajectory_id: str, body: FinishRequest, rt: Runtime = Depends(get_rt)
) -> FinishedTrajectory:
    validate_id(trajectory_id)
    if body.group_id is not None:
        validate_id(body.group_id, what="group_id")
    live = rt.tracker.get(trajectory_id) or await rt.restorer.restore(trajectory_id)
    if live is not None and live.aborted is not None:
        raise Conflict(f"trajectory {trajectory_id!r} attempt {live.attempt} was aborted "
                       f"({live.aborted}); it takes no reward", param="trajectory_id")
    group = body.group_id or (live.group_id if live else None)
    now = time.time()
    async with rt.sessionmaker() as session, session.begin():
        traj = await queries.finish_trajectory(
            session, trajectory_id=trajectory_id, group_id=group, reward=body.reward,
            metadata=body.metadata, now=now, attempt=live.attempt if live else None,
            rewards=body.rewards)
    if live is not None and live.finished_at is None:
        rt.tracker.finish(trajectory_id, body.reward, now)
        rt.dispatcher.scheduler.trajectory_finished(live)
    return FinishedTrajectory(id=traj.id, attempt=traj.attempt, group_id=traj.group_id,
                              reward=traj.reward, finished_at=traj.finished_at,
                              rewards=traj.rewards)


@router.get("/{trajectory_id}/live", summary="The gateway's live view of the trajectory "
            "(404 when this gateway does not track it)")
async def live(trajectory_id: str, rt: Runtime = Depends(get_rt)) -> LiveView:
    """Cheap (memory only): a sharded gateway's front asks each shard who holds an id."""
    validate_id(trajectory_id)
    view = live_view(rt, trajectory_id)
    if view is None:
        raise NotFound(f"this gateway does not track trajectory {trajectory_id!r}")
    return view


@router.post("/{trajectory_id}/abort", summary="Abort the trajectory's live attempt: its "
             "generating calls end (finish_reason abort), later calls are 409 until restart")
async def abort(trajectory_id: str, body: AbortRequest | None = None,
                rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    """For step modes that stop what the trainer will not train on (docs/step-modes.md)."""
    validate_id(trajectory_id)
    return await abort_trajectory(rt, trajectory_id, (body or AbortRequest()).reason)


@router.post("/{trajectory_id}/restart", summary="Lift an abort: the id's next call opens "
             "its next attempt")
async def restart(trajectory_id: str, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    validate_id(trajectory_id)
    state = rt.tracker.get(trajectory_id)
    if state is None:
        raise NotFound(f"no live record of trajectory {trajectory_id!r}")
    nxt = rt.tracker.restart(trajectory_id)
    if nxt is None:
        raise Conflict(f"trajectory {trajectory_id!r} is not aborted", param="trajectory_id")
    return {"id": trajectory_id, "next_attempt": nxt}


@router.post("/{trajectory_id}/key", summary="Mint a harness key for this trajectory only "
             "(model calls; a call naming another trajectory is 403)")
async def mint_key(request: Request, trajectory_id: str,
                   body: KeyRequest | None = None) -> HarnessKey:
    """The key names its trajectory: a harness needs only the gateway's ``/v1`` URL and
    it. Verified statelessly (an HMAC under the key secret), so it is not stored."""
    validate_id(trajectory_id)
    group = body.group_id if body is not None else None
    if group is not None:
        validate_id(group, what="group_id")
    key = get_access(request).signer.mint(trajectory_id, group)
    return HarnessKey(key=key, trajectory_id=trajectory_id, group_id=group)


_ATTEMPT = Query(None, ge=0, le=2**31 - 1)


async def load_attempt(rt: Runtime, trajectory_id: str, attempt: int | None, *,
                       routes: bool = True
                       ) -> tuple[Trajectory, Sequence[Call], TrajectoryAttempt | None]:
    """:func:`_load`, and the record of ``attempt`` when it is not the latest."""
    traj, calls = await _load(rt, trajectory_id, attempt, routes=routes)
    record = None
    if attempt is not None and attempt != traj.attempt:
        async with rt.sessionmaker() as session:
            record = await queries.get_attempt(session, trajectory_id=trajectory_id,
                                               attempt=attempt)
    return traj, calls, record


def _check_staleness(trajectory_id: str, stale: int, bound: int | None) -> None:
    if bound is not None and stale > bound:
        raise Conflict(f"trajectory {trajectory_id!r} is {stale} versions stale (bound "
                       f"{bound})", param="max_staleness")


async def _samples(rt: Runtime, trajectory_id: str, attempt: int | None, branches: str,
                   current_version: str | None, max_staleness: int | None,
                   model: str | None) -> list[Sample]:
    traj, calls, record = await load_attempt(rt, trajectory_id, attempt)
    if not has_calls_for(calls, model):
        raise NotFound(f"trajectory {trajectory_id!r} has no call for model {model!r} "
                       f"(models: {sorted({c.model for c in calls})})", param="model")
    built = build_samples(traj, calls, attempt=attempt, record=record, branches=branches,
                          current_version=versus(rt, current_version, model), model=model)
    _check_staleness(trajectory_id, max((s.max_staleness or 0 for s in built), default=0),
                     max_staleness)
    return built


@router.get("/{trajectory_id}/sample", summary="One branch of one attempt of the trajectory "
            "as a training sample (default: the main branch of its latest attempt)")
async def sample(
    trajectory_id: str,
    attempt: int | None = _ATTEMPT,
    branch: int | None = Query(None, ge=0, le=2**31 - 1, description="default: the main "
                               "branch (the task's conversation, trained whole)"),
    max_staleness: int | None = MAX_STALENESS,
    current_version: str | None = CURRENT,
    model: str | None = MODEL,
    rt: Runtime = Depends(get_rt),
) -> Sample:
    built = await _samples(rt, trajectory_id, attempt, "all", current_version, max_staleness,
                           model)
    found = next((s for s in built if (s.main if branch is None else s.branch == branch)),
                 None)
    if found is None:
        raise NotFound(f"trajectory {trajectory_id!r} has no branch {branch} (branches: "
                       f"{[s.branch for s in built]})", param="branch")
    return found


@router.get("/{trajectory_id}/samples", summary="Every branch of one attempt of the "
            "trajectory as its own training sample (docs/token-capture.md)")
async def samples(
    trajectory_id: str,
    attempt: int | None = _ATTEMPT,
    branches: Literal["all", "main", "longest"] = Query(
        "all", description="all branches, the main one, or the one with the most "
        "generated tokens"),
    max_staleness: int | None = MAX_STALENESS,
    current_version: str | None = CURRENT,
    model: str | None = MODEL,
    rt: Runtime = Depends(get_rt),
) -> SampleList:
    built = await _samples(rt, trajectory_id, attempt, branches, current_version,
                           max_staleness, model)
    return SampleList(data=built)


@router.get("/{trajectory_id}/tree", summary="One attempt of the trajectory as a prefix "
            "tree: each token of its branches once, every generated token trained once "
            "(docs/token-capture.md)")
async def tree(
    trajectory_id: str,
    attempt: int | None = _ATTEMPT,
    max_staleness: int | None = MAX_STALENESS,
    current_version: str | None = CURRENT,
    model: str | None = MODEL,
    rt: Runtime = Depends(get_rt),
) -> SampleTree:
    traj, calls, record = await load_attempt(rt, trajectory_id, attempt)
    built = build_tree(traj, calls, attempt=attempt, record=record,
                       current_version=versus(rt, current_version, model), model=model)
    _check_staleness(trajectory_id, built.max_staleness or 0, max_staleness)
    return built
