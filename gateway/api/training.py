"""The trainer's reports about training on what the gateway recorded (trainer role).

``POST /training/mismatch``: one step's training-inference mismatch (built by
``gateway.client.mismatch``); answered as the gateway judged it, ``alarms`` filled in
against its limits. ``GET /training/mismatch``: the limits and the latest reports.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from gateway.api.deps import get_rt, require_trainer
from gateway.runtime import Runtime
from gateway.schema.mismatch import MismatchReport

router = APIRouter(prefix="/training", tags=["training"],
                   dependencies=[Depends(require_trainer)])


@router.post("/mismatch", summary="Report one step's training-inference mismatch",
             response_model=MismatchReport)
async def report_mismatch(report: MismatchReport,
                          rt: Runtime = Depends(get_rt)) -> MismatchReport:
    return rt.mismatch.add(report)


@router.get("/mismatch", summary="The mismatch limits and the latest reports, newest first")
async def mismatch_reports(rt: Runtime = Depends(get_rt),
                           limit: int = Query(20, ge=1, le=200)) -> dict[str, Any]:
    return rt.mismatch.view(limit)
