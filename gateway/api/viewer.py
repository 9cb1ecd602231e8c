"""The trajectory viewer's data (trainer role; text for the admin token only, as on
``GET /trajectories/{id}``): one attempt laid out for reading, a window of one branch's
routed experts, and a group side by side. The pages that read them are ``/view/...``
(:mod:`gateway.api.web`); docs/status-page.md describes both.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from gateway.api.deps import get_rt, is_admin, require_trainer
from gateway.api.sampling import MODEL, versus
from gateway.api.trajectories import DRAIN_TIMEOUT_S, live_view, load_attempt
from gateway.errors import NotFound
from gateway.runtime import Runtime
from gateway.schema.views import GroupView, TrajectoryView, ViewTokens
from gateway.store import queries
from gateway.store.models import Call, Trajectory, TrajectoryAttempt
from gateway.store.samples import BranchBuild, build_branches, has_calls_for, routes_window
from gateway.store.views import group_view, view_branches, view_calls, view_tokens
from gateway.trajectories.tagging import validate_id

router = APIRouter(tags=["viewer"], dependencies=[Depends(require_trainer)])
#: positions one routes window may span (a hover asks for the window around it)
ROUTES_WINDOW = 1024
#: trajectories a group page lists
GROUP_MEMBERS = 1024

_ATTEMPT = Query(None, ge=0, le=2**31 - 1, description="default: the latest")
_BRANCH = Query(None, ge=0, le=2**31 - 1, description="default: the main branch")


def _pick(ordered: list[BranchBuild], main: BranchBuild | None, trajectory_id: str,
          branch: int | None) -> BranchBuild | None:
    if main is None:
        return None
    if branch is None:
        return main
    found = next((b for b in ordered if b.sample.branch == branch), None)
    if found is None:
        raise NotFound(f"trajectory {trajectory_id!r} has no branch {branch} (branches: "
                       f"{[b.sample.branch for b in ordered]})", param="branch")
    return found


def _engines(rt: Runtime, base: str, calls: list[Call]) -> list[str]:
    """Where the branch's ids can be decoded: this gateway's engines of ``base``, else the
    engines that served its calls (behind a sharded front, the shard answering may hold
    none of that model's engines)."""
    urls = [b.url for b in rt.dispatcher.registry.routable(base)]
    served = [c.backend_url for c in sorted(calls, key=lambda c: -c.seq) if c.backend_url]
    return list(dict.fromkeys(urls + served))


async def _pieces(rt: Runtime, tokens: ViewTokens, calls: list[Call]) -> None:
    """Decode the branch's ids with an engine of its calls' model (its LoRA family's base)."""
    on_path = {seq for seq, *_ in tokens.calls}
    models = Counter(c.model for c in calls if c.seq in on_path)
    if not models:
        return
    model = models.most_common(1)[0][0]
    base = rt.adapters.base_of(model) or model
    urls = _engines(rt, base, [c for c in calls if c.seq in on_path])
    if not urls:
        tokens.pieces_note = f"no engine serving {base!r} is known to decode the tokens"
        return
    decoded = await rt.token_text.decode(rt.session, urls[0], base, tokens.token_ids)
    tokens.pieces, tokens.pieces_note = decoded.pieces, decoded.note


@router.get("/trajectories/{trajectory_id}/view", summary="One attempt of a trajectory "
            "laid out for the viewer: calls and timings, branch tree, one branch's tokens")
async def trajectory_view(
    request: Request, trajectory_id: str, attempt: int | None = _ATTEMPT,
    branch: int | None = _BRANCH, model: str | None = MODEL, rt: Runtime = Depends(get_rt),
) -> TrajectoryView:
    text = is_admin(request)
    traj, calls, record = await load_attempt(rt, trajectory_id, attempt, routes=False)
    which = traj.attempt if attempt is None else attempt
    current = versus(rt, None, model)
    ordered, main = build_branches(traj, calls, attempt=which, record=record, model=model,
                                   routes=False)
    chosen = _pick(ordered, main, trajectory_id, branch)
    tokens = None
    if chosen is not None and main is not None:
        tokens = view_tokens(chosen, main, calls, model)
        if text:
            await _pieces(rt, tokens, list(calls))
    latest = which == (traj.attempt or 0)
    finished_at, meta, rewards = (traj.finished_at, traj.meta, traj.rewards) if latest else (
        (record.finished_at, record.meta, record.rewards) if record else (None, None, None))
    # the sample's own reward: the attempt's, or with ``model`` that policy's
    reward = ordered[0].sample.reward
    return TrajectoryView(
        id=traj.id, attempt=which, attempts=list(range((traj.attempt or 0) + 1)),
        group_id=traj.group_id, reward=reward, rewards=rewards,
        created_at=traj.created_at, finished_at=finished_at, metadata=meta,
        live=live_view(rt, traj.id) if latest else None, current_version=current,
        models=sorted({c.model for c in calls}), text=text,
        calls=view_calls(calls, text=text),
        branches=view_branches(ordered, main, current) if main is not None else [],
        tokens=tokens)


def _window(traj: Trajectory, calls: Sequence[Call], record: TrajectoryAttempt | None,
            which: int, branch: int | None, model: str | None, start: int,
            end: int | None) -> dict[str, Any]:
    """One branch's routed experts from ``start``: only its calls' parts are decoded and
    only the window is laid (a hover asks a window at a time)."""
    ordered, main = build_branches(traj, calls, attempt=which, record=record, model=model,
                                   encode=False)
    chosen = _pick(ordered, main, traj.id, branch)
    stop = min(start + ROUTES_WINDOW, end if end is not None else 2**31)
    if chosen is not None:
        stop = min(stop, len(chosen.sample.token_ids))
    arr = routes_window(chosen.routes, start, stop) if chosen is not None else None
    if chosen is None or arr is None:
        raise NotFound(f"trajectory {traj.id!r} has no routed experts recorded on that "
                       "branch", param="branch")
    return {"branch": chosen.sample.branch, "start": start, "end": start + len(arr),
            "layers": int(arr.shape[1]), "top_k": int(arr.shape[2]), "rows": arr.tolist()}


@router.get("/trajectories/{trajectory_id}/routes", summary="A window of one branch's "
            "routed experts (MoE routing replay), one row of layers x top_k ids a position")
async def routes_window_route(
    trajectory_id: str, attempt: int | None = _ATTEMPT, branch: int | None = _BRANCH,
    start: int = Query(0, ge=0, le=2**31 - 1),
    end: int | None = Query(None, ge=1, le=2**31 - 1, description=f"default and at most "
                            f"start + {ROUTES_WINDOW}"),
    model: str | None = MODEL, rt: Runtime = Depends(get_rt),
) -> dict[str, Any]:
    traj, calls, record = await load_attempt(rt, trajectory_id, attempt)
    which = traj.attempt if attempt is None else attempt
    # decoding a long branch's routes takes a while: off the event loop
    return await asyncio.to_thread(_window, traj, calls, record, which, branch, model,
                                   start, end)


@router.get("/groups/{group_id}/view", summary="A GRPO group's trajectories side by side: "
            "rewards, lengths, the advantage each gets, staleness")
async def group_page(group_id: str, model: str | None = MODEL,
                     rt: Runtime = Depends(get_rt)) -> GroupView:
    validate_id(group_id, what="group_id")
    await rt.writer.drain(DRAIN_TIMEOUT_S)
    rows = []
    async with rt.sessionmaker() as session:
        for traj in await queries.group_trajectories(session, group_id=group_id,
                                                     limit=GROUP_MEMBERS):
            calls = await queries.get_calls(session, trajectory_id=traj.id,
                                            attempt=traj.attempt, routes=False)
            if has_calls_for(calls, model):  # another policy's trajectory: not a member
                rows.append((traj, calls))
    if not rows:
        raise NotFound(f"no trajectory of group {group_id!r} is recorded"
                       + (f" with a call for {model!r}" if model else ""), param="group_id")
    phases = {t.id: st.phase.value for t, _ in rows if (st := rt.tracker.get(t.id))}
    return group_view(group_id, rows, current_version=versus(rt, None, model), model=model,
                      phases=phases)
