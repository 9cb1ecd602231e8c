"""The weight-version answers of the admin API that the trainer reads."""

from __future__ import annotations

from pydantic import BaseModel


class WeightVersionChange(BaseModel):
    """``PUT /admin/weight-version``: the version calls were stamped with until now, and
    the one they get from now on."""

    previous: str
    version: str
