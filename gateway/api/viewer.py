"""The trajectory viewer's data (trainer role; text for the admin token only, as on
``GET /trajectories/{id}``): one attempt laid out for reading, a window of one branch's
routed experts, and a group side by side. The pages that read them are ``/view/...``
(:mod:`gateway.api.web`); docs/status-page.md describes both.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from gateway.api.deps import get_rt, is_admin, require_trainer
from gateway.api.sampling import MODEL, versus
from gateway.api.trajectories import DRAIN_TIMEOUT_S, live_view, load_attempt
from gateway.errors import NotFound
from gateway.runtime import Runtime
from gateway.schema.views import GroupView, TrajectoryView, ViewTokens
from gateway.store import queries
from gateway.store.models import Call
from gateway.store.routes import from_field
from gateway.store.samples import BranchBuild, build_branches
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


async def _pieces(rt: Runtime, tokens: ViewTokens, calls: list[Call]) -> None:
    """Decode the branch's ids with an engine of its calls' model (its LoRA family's base)."""
    on_path = {seq for seq, *_ in tokens.calls}
    models = Counter(c.model for c in calls if c.seq in on_path)
    if not models:
        return
    model = models.most_common(1)[0][0]
    base = rt.adapters.base_of(model) or model
    backends = rt.dispatcher.registry.routable(base)
    if not backends:
        tokens.pieces_note = f"no engine serving {base!r} is up to decode the tokens"
        return
    decoded = await rt.token_text.decode(rt.session, backends[0].url, base,
                                         tokens.token_ids)
    tokens.pieces, tokens.pieces_note = decoded.pieces, decoded.note


@router.get("/trajectories/{trajectory_id}/view", summary="One attempt of a trajectory "
            "laid out for the viewer: calls and timings, branch tree, one branch's tokens")
async def trajectory_view(
    request: Request, trajectory_id: str, attempt: int | None = _ATTEMPT,
    branch: int | None = _BRANCH, model: str | None = MODEL, rt: Runtime = Depends(get_rt),
) -> TrajectoryView:
    text = is_admin(request)
    traj, calls, record = await load_attempt(rt, trajectory_id, attempt)
    which = traj.attempt if attempt is None else attempt
    current = versus(rt, None, model)
    ordered, main = build_branches(traj, calls, attempt=which, record=record, model=model,
                                   routes=False)
    chosen = _pick(ordered, main, trajectory_id, branch)
    tokens = None
    if chosen is not None and main is not None:
        tokens = view_tokens(chosen, main, calls)
        if text:
            await _pieces(rt, tokens, list(calls))
    latest = which == (traj.attempt or 0)
    reward, finished_at, meta = (traj.reward, traj.finished_at, traj.meta) if latest else (
        (record.reward, record.finished_at, record.meta) if record else (None, None, None))
    return TrajectoryView(
        id=traj.id, attempt=which, attempts=list(range((traj.attempt or 0) + 1)),
        group_id=traj.group_id, reward=reward, created_at=traj.created_at,
        finished_at=finished_at, metadata=meta,
        live=live_view(rt, traj.id) if latest else None, current_version=current,
        models=sorted({c.model for c in calls}), text=text,
        calls=view_calls(calls, text=text),
        branches=view_branches(ordered, main, current) if main is not None else [],
        tokens=tokens)


@router.get("/trajectories/{trajectory_id}/routes", summary="A window of one branch's "
            "routed experts (MoE routing replay), one row of layers x top_k ids a position")
async def routes_window(
    trajectory_id: str, attempt: int | None = _ATTEMPT, branch: int | None = _BRANCH,
    start: int = Query(0, ge=0, le=2**31 - 1),
    end: int | None = Query(None, ge=1, le=2**31 - 1, description=f"default and at most "
                            f"start + {ROUTES_WINDOW}"),
    model: str | None = MODEL, rt: Runtime = Depends(get_rt),
) -> dict[str, Any]:
    traj, calls, record = await load_attempt(rt, trajectory_id, attempt)
    which = traj.attempt if attempt is None else attempt
    ordered, main = build_branches(traj, calls, attempt=which, record=record, model=model)
    chosen = _pick(ordered, main, trajectory_id, branch)
    if chosen is None or chosen.sample.routed_experts is None:
        raise NotFound(f"trajectory {trajectory_id!r} has no routed experts recorded on "
                       "that branch", param="branch")
    arr = from_field(chosen.sample.routed_experts)
    stop = min(len(arr), start + ROUTES_WINDOW, end if end is not None else len(arr))
    return {"branch": chosen.sample.branch, "start": start, "end": max(start, stop),
            "layers": int(arr.shape[1]), "top_k": int(arr.shape[2]),
            "rows": arr[start:stop].tolist()}


@router.get("/groups/{group_id}/view", summary="A GRPO group's trajectories side by side: "
            "rewards, lengths, the advantage each gets, staleness")
async def group_page(group_id: str, model: str | None = MODEL,
                     rt: Runtime = Depends(get_rt)) -> GroupView:
    validate_id(group_id, what="group_id")
    await rt.writer.drain(DRAIN_TIMEOUT_S)
    rows = []
    async with rt.sessionmaker() as session:
        found = await queries.list_trajectories(
            session, where=queries.TrajectoryFilter(group_id=group_id), limit=GROUP_MEMBERS)
        for summary in found:
            traj = summary.trajectory
            rows.append((traj, await queries.get_calls(
                session, trajectory_id=traj.id, attempt=traj.attempt)))
    if not rows:
        raise NotFound(f"no trajectory of group {group_id!r} is recorded", param="group_id")
    phases = {t.id: st.phase.value for t, _ in rows if (st := rt.tracker.get(t.id))}
    return group_view(group_id, rows, current_version=versus(rt, None, model), model=model,
                      phases=phases)
