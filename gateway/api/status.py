"""Health, Prometheus metrics and the status JSON (the status page is a view of it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from gateway.api.deps import get_rt
from gateway.runtime import Runtime

router = APIRouter(tags=["status"])


@router.get("/health", summary="Readiness: 200 while serving, 503 while shutting down")
async def health(rt: Runtime = Depends(get_rt)) -> Response:
    healthy = sum(1 for b in rt.registry if b.routable)
    body = {"status": "ok" if rt.ready else "shutting_down", "backends_routable": healthy}
    return JSONResponse(body, status_code=200 if rt.ready else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(rt: Runtime = Depends(get_rt)) -> Response:
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/status", summary="Live state of the pool, trajectories and trace writer")
async def status(rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    phases: dict[str, int] = {}
    for st in rt.tracker:
        phases[st.phase.value] = phases.get(st.phase.value, 0) + 1
    return {
        "policy": rt.dispatcher.placement.name,
        "weight_version": rt.weight_version,
        "backends": [
            {"id": b.id, "url": b.url, "tp": b.tp or 1, "state": b.state.value,
             "healthy": b.healthy, "in_flight": b.in_flight, "served": b.served,
             "failures": b.failures, "models": sorted(b.models), "last_error": b.last_error}
            for b in rt.registry
        ],
        "trajectories": {"total": len(rt.tracker), "by_phase": phases},
        "trace_writer": {"queue_depth": rt.writer.queue_depth, "written": rt.writer.written,
                         "dropped": rt.writer.dropped, "write_errors": rt.writer.write_errors,
                         "spooled": rt.writer.spooled, "spool_bytes": rt.writer.spool_bytes,
                         "db_ok": rt.writer.db_ok,
                         "last_error": rt.writer.last_error},
    }
