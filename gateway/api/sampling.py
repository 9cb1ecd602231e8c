"""Query parameters the sample routes share (``/trajectories``, ``/groups``)."""

from __future__ import annotations

from fastapi import Query

from gateway.runtime import Runtime

MAX_STALENESS = Query(None, ge=0, description="answer 409 if a generated token is more "
                      "versions behind than this")
CURRENT = Query(None, max_length=128, description="staleness is measured against this "
                "(default: the gateway's weight version, or with model that model's)")
MODEL = Query(None, min_length=1, max_length=256, description="one policy's samples (a "
              "trajectory may call several models, a solver and a verifier): its branches "
              "only, its generated tokens trained, main its conversation the trajectory "
              "ended on (docs/weight-updates.md, \"Several policies\")")


def versus(rt: Runtime, current_version: str | None, model: str | None) -> str:
    """The version staleness is measured against: the one asked, or ``model``'s (the
    gateway's without a model)."""
    return current_version or (rt.version_of(model) if model else rt.weight_version)
