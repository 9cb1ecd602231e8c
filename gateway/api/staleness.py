"""The staleness bound (bearer admin token): the gateway's, and a model's own.

A live trajectory is aborted once it started (its first call for a model arrived) more of
that model's weight versions behind than the bound (docs/step-modes.md); each model (a
served model or a LoRA family: ``gateway.adapters``) counts its own versions.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from gateway.api.deps import get_rt, require_admin
from gateway.errors import NotFound
from gateway.runtime import Runtime
from gateway.weights.aborts import enforce_staleness

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


_BOUND = Field(None, ge=0, description="abort a live trajectory once it started (its first "
               "call for a model arrived) more of that model's weight versions behind than "
               "this (null: no bound); integer versions only")


class Staleness(BaseModel):
    """``PUT /admin/staleness``: the gateway's bound, or one model's."""

    max_staleness: int | None = _BOUND
    model: str | None = Field(None, min_length=1, max_length=256, description="the bound "
                              "of this model (a LoRA family) alone, in place of the "
                              "gateway's; with null max_staleness it takes the gateway's "
                              "again")


class Bounds(BaseModel):
    """``GET /admin/staleness``."""

    max_staleness: int | None = _BOUND
    models: dict[str, int] = Field(default_factory=dict, description="the models with a "
                                   "bound of their own")


@router.get("/staleness")
async def get_staleness(rt: Runtime = Depends(get_rt)) -> Bounds:
    """The staleness bound, and the models' own (docs/step-modes.md)."""
    return Bounds(max_staleness=rt.max_staleness, models=dict(rt.model_staleness))


@router.put("/staleness")
async def set_staleness(body: Staleness, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    """Set (or lift, with null) the staleness bound, the gateway's or one model's;
    trajectories already past it are aborted now, the others when a weight version change
    takes them past it."""
    if body.model is None:
        rt.max_staleness = body.max_staleness
    elif body.model not in (known := rt.model_names(rt.tracker.by_model())):
        raise NotFound(f"model {body.model!r} is not served here; models: {known}",
                       param="model")
    elif body.max_staleness is None:
        rt.model_staleness.pop(body.model, None)
    else:
        rt.model_staleness[body.model] = body.max_staleness
    rt.events.emit("staleness", f"staleness bound {body.max_staleness}"
                   + (f" for {body.model}" if body.model else ""),
                   max_staleness=body.max_staleness, model=body.model)
    return {"max_staleness": body.max_staleness,
            **({"model": body.model} if body.model is not None else {}),
            "aborted": await enforce_staleness(rt)}
