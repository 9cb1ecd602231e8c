"""Per-TP speed estimates handed to policies, fitted from a latency profile.

A :class:`~gateway.policies.base.TPSpeed` says how fast one instance of a TP degree
decodes alone and how much each extra sequence slows it (Heddle's interference factor
F(n), section 5). The gateway takes them from the latency profile of the model and GPU
it serves (``DispatchSettings.speed_profile``); the simulator uses the same function. A
live gateway then corrects them with what its engines measure (:class:`SpeedMeter`): the
status page shows the speeds the policy believes and where each came from.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import replace

from backends.sim.profiles import LatencyProfile, load_profile
from gateway.policies.base import TPSpeed

TYPICAL_CONTEXT = 16000
TP_DEGREES = (1, 2, 4, 8)
#: batch sizes at which the decode-step curve is read (TPSpeed.curve)
CURVE_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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
    curve = tuple((n, p.step_ms(num_tokens=n) / 1000.0) for n in CURVE_POINTS)
    return TPSpeed(one / 1000.0, num / den, prefill_ms / 1000.0,
                   fixed_ms / 1000.0, seq_ms / 1000.0, ctx_ms / 1000.0,
                   kv_tokens=p.kv_capacity_tokens, curve=curve)


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


#: calls of one TP degree before its measured factor replaces the profile's
MIN_CALLS = 8
#: calls kept per TP degree (the factor is their median: robust to a stalled call)
WINDOW = 256
#: the most a degree's factor is taken to move per TP doubling, on the trend of two measured
#: degrees (log): the published band for TP scaling spans 1.6x a doubling
#: (docs/tp-efficiency.md: TP8/TP1 from 1.15x to 4.7x)
MAX_TREND = math.log(1.6)


class SpeedMeter:
    """The per-TP speeds the policy believes: the profile's, scaled by what the engines
    measured.

    Every ok call of a known TP reports its decode time per generated token (as the
    gateway timed it, or for a call that is not streamed as its engine did, where the
    engine reports it: :meth:`observe_engine`) and how many calls its instance ran at the
    time; the profile predicts that same step on the curve the policies plan with
    (:meth:`TPSpeed.decode_step_s`), and the median of
    measured/predicted over the last :data:`WINDOW` calls is the TP's factor. A TP with
    fewer than :data:`MIN_CALLS` calls takes the trend of the two nearest measured TPs (in
    log2 of the degree: what slows TP2 down relative to TP1, all-reduce or per-step
    overhead, slows TP4 more), at most :data:`MAX_TREND` a doubling; with one measured, its
    factor; with none, the profile stands. Times are in engine seconds: a simulated pool
    compressed ``time_scale`` times is scaled back.
    """

    def __init__(self, prior: Mapping[int, TPSpeed], time_scale: float = 1.0) -> None:
        self.prior = dict(prior)
        self.time_scale = time_scale
        self._ratios: dict[int, deque[float]] = {}
        self._current: dict[int, TPSpeed] | None = None

    def observe(self, tp: int, decode_s: float, tokens: int, running: int,
                context_tokens: int) -> None:
        """One call's decode as the gateway timed it: ``decode_s`` seconds for ``tokens``
        generated tokens on an instance running ``running`` calls, this one holding
        ``context_tokens``."""
        if tokens >= 2 and decode_s > 0:
            self._add(tp, decode_s * self.time_scale / tokens, running, context_tokens)

    def observe_engine(self, tp: int, step_s: float, running: int, context_tokens: int) -> None:
        """One call's decode as its engine timed it: ``step_s`` engine seconds a token
        (the engine's mean inter-token latency while the call ran), the rest as
        :meth:`observe`."""
        if step_s > 0:
            self._add(tp, step_s, running, context_tokens)

    def _add(self, tp: int, step_s: float, running: int, context_tokens: int) -> None:
        """A step of ``step_s`` engine seconds measured: its ratio to the profile's."""
        prior = self.prior.get(tp)
        if prior is None:
            return
        n = max(1, running)
        predicted = _step(prior, n, n * context_tokens)
        if predicted > 0:
            self._ratios.setdefault(tp, deque(maxlen=WINDOW)).append(step_s / predicted)
            self._current = None

    def factor(self, tp: int) -> tuple[float, str, int]:
        """(factor on the profile's times, where it comes from, calls measured)."""
        own = self._ratios.get(tp, ())
        if len(own) >= MIN_CALLS:
            return statistics.median(own), "measured", len(own)
        others = {t: statistics.median(r) for t, r in self._ratios.items()
                  if len(r) >= MIN_CALLS}
        ranked = sorted(others, key=lambda t: (abs(math.log2(t) - math.log2(tp)), -t))
        if len(ranked) >= 2:  # the trend of the two nearest, per TP doubling
            a, b = sorted(ranked[:2])
            per = (math.log(others[b]) - math.log(others[a])) / math.log2(b / a)
            per = max(-MAX_TREND, min(MAX_TREND, per))
            near = ranked[0]  # from the nearest one's own factor
            f = others[near] * math.exp(per * math.log2(tp / near))
            return f, f"on the trend of TP{a} and TP{b}", len(own)
        if ranked:  # the one measured degree
            return others[ranked[0]], f"as measured at TP{ranked[0]}", len(own)
        return 1.0, "profile", len(own)

    def current(self) -> dict[int, TPSpeed]:
        """The speeds to hand policies now (cached until the next observation)."""
        if self._current is None:
            self._current = {tp: _scaled(s, self.factor(tp)[0]) for tp, s in self.prior.items()}
        return self._current

    def borrowed(self) -> frozenset[int]:
        """The degrees whose factor is not their own (fewer than :data:`MIN_CALLS` calls
        measured): the profile's, or another degree's measurement."""
        return frozenset(tp for tp in self.prior if len(self._ratios.get(tp, ())) < MIN_CALLS)

    def table(self) -> list[dict[str, object]]:
        """Per TP, for ``/status`` and the page: the believed decode step alone and at 64
        calls (ms), the factor and its source."""
        rows: list[dict[str, object]] = []
        for tp, s in sorted(self.current().items()):
            f, source, calls = self.factor(tp)
            rows.append({"tp": tp, "step_ms_1": round(_step(s, 1) * 1000, 3),
                         "step_ms_64": round(_step(s, 64) * 1000, 3), "factor": round(f, 3),
                         "source": source, "calls": calls})
        return rows


def _step(s: TPSpeed, n: int, ctx_tokens: int | None = None) -> float:
    """One decode step of ``n`` calls as policies plan it: on the fitted curve (a batch of
    a few calls is weight-bound, well above the straight line through large batches)."""
    if not s.fixed_s:
        return s.step_s(n)
    return s.decode_step_s(n, n * TYPICAL_CONTEXT if ctx_tokens is None else ctx_tokens)


def _scaled(s: TPSpeed, f: float) -> TPSpeed:
    if f == 1.0:
        return s
    return replace(s, per_token_s=s.per_token_s * f, prefill_s_per_token=s.prefill_s_per_token * f,
                   fixed_s=s.fixed_s * f, seq_s=s.seq_s * f, ctx_s=s.ctx_s * f,
                   curve=tuple((n, t * f) for n, t in s.curve))
