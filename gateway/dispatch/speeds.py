"""Per-TP speed estimates handed to policies, fitted from a latency profile.

A :class:`~gateway.policies.base.TPSpeed` says how fast one instance of a TP degree
decodes alone and how much each extra sequence slows it (Heddle's interference factor
F(n), section 5). The gateway takes them from the latency profile of the model and GPU
it serves (``DispatchSettings.speed_profile``); the simulator uses the same function.
"""

from __future__ import annotations

from backends.sim.profiles import LatencyProfile, load_profile
from gateway.policies.base import TPSpeed

TYPICAL_CONTEXT = 16000
TP_DEGREES = (1, 2, 4, 8)


def fit_speed(p: LatencyProfile, ctx: int = TYPICAL_CONTEXT) -> TPSpeed:
    """Lone-decode per-token time at ``ctx`` and the least-squares slope of F(n), n<=64."""
    one = p.step_ms(num_tokens=1, decode_ctx_tokens=ctx)
    xs = range(1, 65)
    ys = [p.step_ms(num_tokens=n, decode_ctx_tokens=n * ctx) / one - 1.0 for n in xs]
    num = sum((n - 1) * y for n, y in zip(xs, ys, strict=True))
    den = sum((n - 1) ** 2 for n in xs)
    chunk = 2048
    prefill_ms = p.step_ms(num_tokens=chunk, prefill_attn=chunk * (ctx + chunk / 2)) / chunk
    # the batch model: step(n, C) ~ fixed + seq*n + ctx*C, from two probes each at
    # a decode batch past the weight-streaming knee (64 and 128 sequences)
    lo, hi = 64, 128
    seq_ms = (p.step_ms(num_tokens=hi) - p.step_ms(num_tokens=lo)) / (hi - lo)
    fixed_ms = p.step_ms(num_tokens=lo) - seq_ms * lo
    ctx_ms = (p.step_ms(num_tokens=lo, decode_ctx_tokens=10**6)
              - p.step_ms(num_tokens=lo)) / 10**6
    return TPSpeed(one / 1000.0, num / den, prefill_ms / 1000.0,
                   fixed_ms / 1000.0, seq_ms / 1000.0, ctx_ms / 1000.0,
                   kv_tokens=p.kv_capacity_tokens)


def profiles(model: str, gpu: str, tp_penalty: float | None = None,
             max_tp: int = 8) -> dict[int, LatencyProfile]:
    return {tp: load_profile(model, gpu, tp, tp_penalty=tp_penalty)
            for tp in TP_DEGREES if tp <= max_tp}


def speeds(profs: dict[int, LatencyProfile]) -> dict[int, TPSpeed]:
    return {tp: fit_speed(p) for tp, p in profs.items()}


def speeds_for(spec: str) -> dict[int, TPSpeed]:
    """``"model/gpu"`` (e.g. ``qwen3-14b/H100``) -> speeds for every TP it has."""
    model, _, gpu = spec.partition("/")
    out: dict[int, TPSpeed] = {}
    for tp in TP_DEGREES:
        try:
            out[tp] = fit_speed(load_profile(model, gpu, tp))
        except ValueError:
            continue
    if not out:
        raise ValueError(f"no latency profile for {spec!r} (expected MODEL/GPU, e.g. "
                         "qwen3-14b/H100)")
    return out
