"""Speed model handed to policies: per-token time and interference per TP degree.

The simulator uses exactly what the live gateway uses (``gateway.dispatch.speeds``):
fitted from the simulated engine's latency profile, the per-token time of a lone decode
at a typical context, and the slope of the interference factor ``F(n) = step(n) /
step(1)`` (Heddle's F(n), section 5).

:func:`band_profiles` puts the profiles at a point of the TP-efficiency band
(``docs/tp-efficiency.md``): every benchmark takes ``--tp-efficiency``. What a policy is
told of those speeds is :func:`live_beliefs`: by default what a live gateway would know.
"""

from __future__ import annotations

from backends.sim.profiles import (
    VLLM_MEMORY_UTILIZATION,
    LatencyProfile,
    at_memory_utilization,
    penalty_for,
)
from gateway.dispatch.speeds import (
    TP_DEGREES,
    TYPICAL_CONTEXT,
    SpeedMeter,
    fit_speed,
    profiles,
    speeds,
)

__all__ = ["BELIEFS", "TP_DEGREES", "TYPICAL_CONTEXT", "band_profiles", "fit_speed",
           "live_beliefs", "max_tp_for", "profiles", "speeds"]


def max_tp_for(gpus: int) -> int:
    return max(t for t in TP_DEGREES if t <= gpus)


def band_profiles(model: str, gpu: str, where: str | float = "calibrated",
                  max_tp: int = 8,
                  memory: float = VLLM_MEMORY_UTILIZATION) -> dict[int, LatencyProfile]:
    """Profiles of every TP degree up to ``max_tp`` at TP-efficiency ``where`` (``low``,
    ``mid``, ``high``, ``calibrated`` (the default) or a TP8/TP1 ratio), their engines
    taking ``memory`` of each GPU's memory (:func:`at_memory_utilization`; a degree whose
    weights leave no KV cache there is left out)."""
    out = {}
    for tp, p in profiles(model, gpu, penalty_for(model, gpu, where), max_tp).items():
        try:
            out[tp] = at_memory_utilization(p, memory)
        except ValueError:
            continue
    if not out:
        raise ValueError(f"no TP degree of {model}/{gpu} fits at gpu_memory_utilization "
                         f"{memory}")
    return out


BELIEFS = ("live", "true")


def live_beliefs(model: str, gpu: str, gpus: int, beliefs: str,
                 memory: float = VLLM_MEMORY_UTILIZATION) -> SpeedMeter | None:
    """The speeds a live gateway would hand policies (one meter for a whole run, as one
    gateway serves every step), or None for the band's true speeds. The KV capacity is
    the engines' own (``memory``: a live gateway reads it off the engines)."""
    if beliefs not in BELIEFS:
        raise ValueError(f"beliefs must be one of {', '.join(BELIEFS)}, not {beliefs!r}")
    if beliefs == "true":
        return None
    return SpeedMeter(speeds(band_profiles(model, gpu, "calibrated", max_tp_for(gpus),
                                           memory)))
