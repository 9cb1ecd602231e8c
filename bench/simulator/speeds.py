"""Speed model handed to policies: per-token time and interference per TP degree.

The simulator uses exactly what the live gateway uses (``gateway.dispatch.speeds``):
fitted from the simulated engine's latency profile, the per-token time of a lone decode
at a typical context, and the slope of the interference factor ``F(n) = step(n) /
step(1)`` (Heddle's F(n), section 5).
"""

from __future__ import annotations

from gateway.dispatch.speeds import TP_DEGREES, TYPICAL_CONTEXT, fit_speed, profiles, speeds

__all__ = ["TP_DEGREES", "TYPICAL_CONTEXT", "fit_speed", "profiles", "speeds"]
