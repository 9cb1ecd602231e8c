"""Admin API (bearer admin token): backends and weight version.

Pool reconfiguration, pause/resume and policy switching join this router as the managed
pool and policies land.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from gateway.api.deps import get_rt, require_admin
from gateway.dispatch.backends import parse_backend_spec
from gateway.errors import BadRequest, NotFound
from gateway.runtime import Runtime

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


class AddBackend(BaseModel):
    url: str = Field(min_length=8, max_length=512)
    tp: int | None = Field(None, ge=1, le=64)
    id: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")


class WeightVersion(BaseModel):
    version: str = Field(min_length=1, max_length=128)


@router.get("/backends")
async def list_backends(rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    return {"data": [{"id": b.id, "url": b.url, "tp": b.tp or 1, "healthy": b.healthy,
                      "state": b.state.value, "in_flight": b.in_flight,
                      "source": b.source} for b in rt.registry]}


@router.post("/backends", status_code=201)
async def add_backend(body: AddBackend, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    try:
        backend = parse_backend_spec(body.url, len(rt.registry))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    backend.id = body.id or f"b{len(rt.registry)}"
    backend.tp = body.tp or backend.tp
    while rt.registry.get(backend.id) is not None:
        backend.id += "x"
    rt.registry.add(backend)
    await rt.health.check(backend)
    return {"id": backend.id, "url": backend.url, "healthy": backend.healthy}


@router.delete("/backends/{backend_id}")
async def remove_backend(backend_id: str, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    backend = rt.registry.remove(backend_id)
    if backend is None:
        raise NotFound(f"no backend {backend_id!r}")
    return {"id": backend.id, "removed": True, "in_flight": backend.in_flight}


@router.put("/weight-version")
async def set_weight_version(body: WeightVersion, rt: Runtime = Depends(get_rt)) -> dict[str, str]:
    previous, rt.weight_version = rt.weight_version, body.version
    return {"previous": previous, "version": rt.weight_version}
