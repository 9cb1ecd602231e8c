"""Health, Prometheus metrics and the status JSON (the status page is a view of it)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from gateway.api.deps import get_rt, is_admin
from gateway.api.live_status import backend_row, live_view, models_view, phase_counts
from gateway.policies.registry import LIVE_NAMES
from gateway.readiness import readiness
from gateway.runtime import Runtime
from gateway.store.writer import TraceWriter

router = APIRouter(tags=["status"])
MISMATCH_SHOWN = 8  # the latest training-inference mismatch reports on /status


@router.get("/health", summary="Liveness: 200 while serving (engines up or not), 503 while "
            "shutting down; the body says whether the pool is ready")
async def health(rt: Runtime = Depends(get_rt)) -> Response:
    healthy = sum(1 for b in rt.registry if b.routable)
    body = {"status": "ok" if rt.ready else "shutting_down", "backends_routable": healthy,
            "recording": rt.writer.refusal is None, "ready": readiness(rt).to_dict()}
    return JSONResponse(body, status_code=200 if rt.ready else 503)


@router.get("/ready", summary="Readiness: 200 once the pool's initial engines are up, 503 "
            "before (and while shutting down)")
async def ready(rt: Runtime = Depends(get_rt)) -> Response:
    state = readiness(rt)
    return JSONResponse(state.to_dict(), status_code=200 if state.ready else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(rt: Runtime = Depends(get_rt)) -> Response:
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/status", summary="Live state of the pool, trajectories and trace writer "
            "(backend URLs for the operator only)")
async def status(request: Request, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    return status_body(rt, with_urls=is_admin(request))


def status_body(rt: Runtime, *, with_urls: bool) -> dict[str, Any]:
    """The status page's data (also sent by ``/status/stream``); shape in docs/status-page.md.
    ``with_urls``: the engines' addresses too, for the operator (see :func:`backend_row`)."""
    states = list(rt.tracker)
    sched = rt.dispatcher.scheduler
    return {
        "policy": rt.dispatcher.policy_name,
        "policies": list(LIVE_NAMES),  # what PUT /admin/policy accepts (the page offers them)
        "weight_version": rt.weight_version,
        "adapters": rt.adapters.to_dict(),  # LoRA adapters by family (weight-updates.md)
        "models": models_view(rt),  # each policy's version and load
        "paused": rt.dispatcher.gate.paused,
        "backends": [backend_row(rt, b, with_url=with_urls) for b in rt.registry],
        "trajectories": {"total": len(states), "by_phase": phase_counts(states)},
        "scheduler": {"queued": sched.queue_depth, "dispatched": sched.dispatched,
                      "faults": sched.faults, "stalls": sched.stalls,
                      "stalled_for_s": round(sched.stalled_for_s, 1)},
        "trace_writer": writer_view(rt.writer) | {"routes_cleared": (
            rt.routes_retention.dropped if rt.routes_retention is not None else 0)},
        "restore": {"restored": rt.restorer.restored, "failures": rt.restorer.failures,
                    "existence_queries": rt.restorer.existence_queries},
        "relayouts": rt.relayouts.summary(),
        "speeds": {"profile": rt.settings.dispatch.speed_profile, "by_tp": sched.meter.table()},
        "training_mismatch": rt.mismatch.view(MISMATCH_SHOWN),
    } | live_view(rt, time.time())


def writer_view(w: TraceWriter) -> dict[str, Any]:
    """The trace writer's state: is every answered call recorded, and what was not."""
    quarantine = w.quarantine
    return {
        "recording": w.refusal is None, "refusal": w.refusal, "running": w.running,
        "restarts": w.restarts, "failure": w.failure,
        "queue_depth": w.queue_depth, "written": w.written, "dropped": w.dropped,
        "routes_dropped": w.routes_dropped, "routes_unwritten": w.routes_unwritten,
        "lost": dict(w.lost), "rejected": w.rejected, "write_errors": w.write_errors,
        "spooled": w.spooled, "spool_bytes": w.spool_bytes, "spool_error": w.spool_error,
        "quarantined": quarantine.total if quarantine else 0,
        "quarantine_file": str(quarantine.path) if quarantine and quarantine.total else None,
        "db_ok": w.db_ok, "last_error": w.last_error,
    }
