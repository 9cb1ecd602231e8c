"""Speed model handed to policies: per-token time and interference per TP degree.

Fitted from the simulated engine's latency profile (``backends.sim.profiles``): the
per-token time of a lone decode at a typical context, and the slope of the interference
factor ``F(n) = step(n) / step(1)`` by least squares over batch sizes 1..64 (Heddle's
F(n), section 5). The live driver builds the same :class:`TPSpeed` from measurements.
"""

from __future__ import annotations

from backends.sim.profiles import LatencyProfile, load_profile
from gateway.policies.base import TPSpeed

TYPICAL_CONTEXT = 16000
TP_DEGREES = (1, 2, 4, 8)


def fit_speed(p: LatencyProfile, ctx: int = TYPICAL_CONTEXT) -> TPSpeed:
    one = p.step_ms(num_tokens=1, decode_ctx_tokens=ctx)
    xs = range(1, 65)
    ys = [p.step_ms(num_tokens=n, decode_ctx_tokens=n * ctx) / one - 1.0 for n in xs]
    num = sum((n - 1) * y for n, y in zip(xs, ys, strict=True))
    den = sum((n - 1) ** 2 for n in xs)
    chunk = 2048
    prefill_ms = p.step_ms(num_tokens=chunk, prefill_attn=chunk * (ctx + chunk / 2)) / chunk
    return TPSpeed(one / 1000.0, num / den, prefill_ms / 1000.0)


def profiles(model: str, gpu: str, tp_penalty: float | None = None,
             max_tp: int = 8) -> dict[int, LatencyProfile]:
    return {tp: load_profile(model, gpu, tp, tp_penalty=tp_penalty)
            for tp in TP_DEGREES if tp <= max_tp}


def speeds(profs: dict[int, LatencyProfile]) -> dict[int, TPSpeed]:
    return {tp: fit_speed(p) for tp, p in profs.items()}
