"""Admin: read and switch the scheduling policy at run time (bearer admin token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from gateway.api.deps import get_rt, require_admin
from gateway.errors import BadRequest
from gateway.policies.registry import LIVE_NAMES, get_policy, resolve_name
from gateway.runtime import Runtime

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])
#: the *-oracle names need the benchmark's hidden lengths; a live gateway never has them.
SWITCHABLE = LIVE_NAMES


class PolicyChange(BaseModel):
    policy: str = Field(min_length=1, max_length=64)


def _describe(rt: Runtime) -> dict[str, Any]:
    s = rt.dispatcher.scheduler
    return {"policy": s.policy.name, "label": s.policy.label, "available": list(SWITCHABLE),
            "queued": s.queue_depth, "migrations": s.migrations, "relayouts": s.relayouts}


@router.get("/policy", summary="The active scheduling policy")
async def current_policy(rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    return _describe(rt)


@router.put("/policy", summary="Switch the scheduling policy (queued calls are rescheduled)")
async def switch_policy(body: PolicyChange, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    name = resolve_name(body.policy)  # an old name still works during the alias period
    if name not in SWITCHABLE:
        raise BadRequest(f"unknown policy {body.policy!r}; available: {', '.join(SWITCHABLE)}",
                         param="policy")
    previous = rt.dispatcher.scheduler.policy.name
    rt.dispatcher.scheduler.set_policy(get_policy(name))  # the monitor logs the event
    return {"previous": previous, **_describe(rt)}
