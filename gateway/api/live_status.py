"""The live part of ``GET /status``: pool, trajectories, throughput, events.

Everything here reads in-memory state (runtime, tracker, monitor): no database, no I/O,
so the status stream can send it every second. Prompt and completion text never appear;
trajectory ids, counts and timings do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gateway.dispatch.backends import Backend
from gateway.metrics import histogram_quantile, sample_sum
from gateway.policies.base import Phase
from gateway.runtime import Runtime
from gateway.trajectories.state import TrajectoryState

GANTT_ROWS = 12
EVENTS_SHOWN = 50
RATE_WINDOW_S = 5.0


def backend_row(rt: Runtime, b: Backend, *, with_url: bool) -> dict[str, Any]:
    """One pool instance: registry facts plus what its engine reported at the last scrape.

    ``url`` only ``with_url`` (the operator's view): an engine's own routes (pause, weight
    updates, in vLLM's dev mode) take no credential, so its address is not public."""
    stats = rt.monitor.engines.get(b.id)
    return {
        "id": b.id, **({"url": b.url} if with_url else {}), "tp": b.tp or 1,
        "gpus": list(b.gpus), "state": b.state.value,
        "healthy": b.healthy, "routable": b.routable, "source": b.source,
        "in_flight": b.in_flight, "served": b.served, "failures": b.failures,
        "models": sorted(b.models), "last_error": b.last_error,
        # whether its answers carry routed experts (MoE routing replay; None: not yet seen)
        "returns_routes": b.returns_routes,
        # (seconds, tokens) the engine timed its decode over, as last scraped: the speed
        # meter's clock for calls not streamed (None: it reports no inter-token latency)
        "decode_clock": list(b.decode_clock) if b.decode_clock is not None else None,
        "engine": stats.as_json() if stats is not None else None,
    }


def models_view(rt: Runtime) -> dict[str, Any]:
    """Each model calls are served for (a served model, or a LoRA family of one: a
    policy): its base, weight version, current adapter, staleness bound, its calls on
    the engines and its weight in the share of its base's slots
    (``gateway.dispatch.shares``), and its live trajectories by phase (each counted under
    the model of its latest call)."""
    by_model = rt.tracker.by_model()
    running = rt.dispatcher.scheduler.running
    shares = rt.settings.dispatch.model_shares
    out = {}
    for name in rt.model_names(by_model):
        adapter = rt.adapters.current(name)
        out[name] = {"base": rt.adapters.base_of(name), "version": rt.version_of(name),
                     "adapter": adapter.name if adapter is not None else None,
                     "max_staleness": rt.bound_for(name),
                     "calls_running": running.get(name, 0), "share": shares.get(name, 1.0),
                     "trajectories": phase_counts(by_model.get(name, []))}
    return out


def live_view(rt: Runtime, now: float) -> dict[str, Any]:
    states = list(rt.tracker)
    backends = list(rt.registry)
    m = rt.metrics
    return {
        "server_time": now,
        "started_at": rt.monitor.started_at,
        "pool": {
            "instances": len(backends),
            "routable": sum(b.routable for b in backends),
            "gpus": sum(len(b.gpus) or (b.tp or 1) for b in backends),
            "running": sum(b.in_flight for b in backends),
            "queued": sum(st.queued for st in states),
        },
        "totals": {
            "calls": sample_sum(m.calls, "_total"),
            "calls_failed": sample_sum(m.calls, "_total", status="error"),
            "prompt_tokens": sample_sum(m.tokens, "_total", kind="prompt"),
            "completion_tokens": sample_sum(m.tokens, "_total", kind="completion"),
            "retries": sample_sum(m.retries, "_total"),
        },
        "rates": rt.monitor.history.recent_rate(RATE_WINDOW_S, now),
        "latency": {
            "queue_p50_s": histogram_quantile(m.queue_time, 0.5),
            "queue_p90_s": histogram_quantile(m.queue_time, 0.9),
            "ttft_p50_s": histogram_quantile(m.ttft, 0.5),
            "ttft_p90_s": histogram_quantile(m.ttft, 0.9),
        },
        "gantt": gantt(states, now, relayouts=rt.relayouts.spans()),
        "lengths": length_distribution(states),
        "history": {"interval_s": rt.monitor.interval_s * rt.monitor.history.stride,
                    "points": [_rounded(p) for p in rt.monitor.history.rates()]},
        "events": rt.events.recent(EVENTS_SHOWN),
    }


def phase_counts(states: list[TrajectoryState]) -> dict[str, int]:
    counts = {p.value: 0 for p in Phase}
    for st in states:
        counts[st.phase.value] += 1
    return counts


def gantt(states: list[TrajectoryState], now: float, rows: int = GANTT_ROWS,
          relayouts: Sequence[tuple[float, float | None, str]] = ()) -> dict[str, Any]:
    """The ``rows`` longest-running trajectories with their queue/LLM/tool segments, and
    the pool's layout changes (``[start, end or null, label]``) on the same time axis.

    Times are seconds relative to ``t0`` (the earliest start shown), so the page can draw
    them on one axis; ``now`` is on the same axis.
    """
    def elapsed(st: TrajectoryState) -> float:
        return (st.finished_at or now) - st.created_at

    slowest = sorted(states, key=elapsed, reverse=True)[:rows]
    if not slowest:
        return {"t0": now, "now": 0.0, "rows": [], "relayouts": []}
    t0 = min(st.created_at for st in slowest)
    return {
        "t0": t0,
        "now": round(now - t0, 3),
        "relayouts": [[round(a - t0, 3), None if b is None else round(b - t0, 3), label]
                      for a, b, label in relayouts if a >= t0],
        "rows": [{
            "id": st.id, "group_id": st.group_id, "phase": st.phase.value,
            "start": round(st.created_at - t0, 3),
            "end": round((st.finished_at or now) - t0, 3),
            "turns": st.turns, "completion_tokens": st.completion_tokens,
            "backend_id": st.backend_id, "llm_s": round(st.llm_time_s, 3),
            "queue_s": round(st.queue_time_s, 3), "tool_s": round(st.tool_time_s, 3),
            "segments": _segments(st, t0, now),
        } for st in slowest],
    }


def _segments(st: TrajectoryState, t0: float, now: float) -> list[list[Any]]:
    """Closed segments, plus the tool call in progress (its gap closes at the next call)."""
    out: list[list[Any]] = [[kind, round(a - t0, 3), round(b - t0, 3)]
                            for kind, a, b in st.segments()]
    if st.phase is Phase.TOOL and st.last_call_end is not None:
        out.append(["tool", round(st.last_call_end - t0, 3), round(now - t0, 3)])
    return out


def length_distribution(states: list[TrajectoryState]) -> dict[str, Any]:
    """Completion tokens per trajectory: power-of-two bins and tail percentiles.

    Live trajectories count with their tokens so far (a lower bound on their length).
    """
    lengths = sorted(st.completion_tokens for st in states if st.calls_done)
    finished = sum(1 for st in states if st.calls_done and st.finished_at is not None)
    if not lengths:
        return {"count": 0, "finished": 0, "bins": [], "p50": None, "p90": None,
                "p99": None, "max": None, "mean": None}
    counts = [0] * (lengths[-1].bit_length() + 1)
    for n in lengths:  # bin k holds [2^(k-1), 2^k - 1]; bin 0 holds 0
        counts[n.bit_length()] += 1
    bins = [{"lo": 0 if k == 0 else 2 ** (k - 1), "hi": 2 ** k - 1 if k else 0, "count": c}
            for k, c in enumerate(counts)]
    first = next(i for i, b in enumerate(bins) if b["count"])
    return {"count": len(lengths), "finished": finished, "bins": bins[first:],
            "p50": _pct(lengths, 0.5), "p90": _pct(lengths, 0.9), "p99": _pct(lengths, 0.99),
            "max": lengths[-1], "mean": round(sum(lengths) / len(lengths), 1)}


def _pct(values: list[int], q: float) -> int:
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def _rounded(point: dict[str, float]) -> list[float]:
    return [round(point["t"], 3), round(point["tokens_per_s"], 2),
            round(point["prompt_tokens_per_s"], 2), round(point["calls_per_s"], 3)]
