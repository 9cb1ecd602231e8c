"""A call that is not streamed is timed by its engine's decode clock where the engine
reports one: the call's own time holds its prefill and its wait behind other prefills,
which on engines unlike the profile (CPU vLLM against an H100 profile) made a call of 13
tokens measure several times a call of 150 on the same engine (docs/policies.md)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.dispatch.backends import Backend
from gateway.dispatch.speeds import SpeedMeter, speeds_for
from gateway.pool.monitor import parse_vllm_metrics
from gateway.proxy.calls import _measure

PRIOR = speeds_for("qwen3-14b/H100")
STEP_S = PRIOR[1].decode_step_s(4, 4 * 1100)  # the profile's step for these calls


def _call(backend: Backend, mark: tuple[float, float] | None, *, stream: bool = False
          ) -> tuple[Any, Any, SpeedMeter]:
    meter = SpeedMeter(PRIOR)
    rt = SimpleNamespace(dispatcher=SimpleNamespace(scheduler=SimpleNamespace(meter=meter)))
    ctx = SimpleNamespace(lease=SimpleNamespace(backend=backend), stream=stream,
                          first_byte=None, dispatched_at=100.0, decode_mark=mark,
                          capture=SimpleNamespace(prompt_ids=list(range(1000))))
    return rt, ctx, meter


def _ratios(meter: SpeedMeter) -> list[float]:
    return list(meter._ratios.get(1, ()))


def test_a_call_not_streamed_takes_the_engines_time_per_token_between_its_scrapes() -> None:
    backend = Backend("b", "http://b", tp=1, decode_clock=(50.0 + 2 * STEP_S * 400, 1000.0 + 400))
    rt, ctx, meter = _call(backend, (50.0, 1000.0))
    # 100 tokens in 30 s: mostly a wait behind other prefills, which the engine's clock
    # leaves out; it decoded 400 tokens at twice the profile's step meanwhile
    _measure(rt, ctx, 30.0, 100, 4)
    assert _ratios(meter) == [pytest.approx(2.0)]


@pytest.mark.parametrize("clock", [(50.0, 1000.0), (1.0, 10.0)], ids=["no scrape", "restarted"])
def test_a_call_that_spans_no_scrape_takes_the_last_two_scrapes(clock: tuple[float, float]
                                                                  ) -> None:
    """Too short to span a scrape, or its engine restarted (its counters went back): the
    engine's time per token between its latest two scrapes; before there are two, the
    call's own time (a backend that served a few short calls is still measured)."""
    latest = Backend("b", "http://b", tp=1, decode_clock=clock, engine_step_s=3 * STEP_S)
    rt, ctx, meter = _call(latest, (50.0, 1000.0))
    _measure(rt, ctx, 30.0, 100, 4)
    assert _ratios(meter) == [pytest.approx(3.0)]
    rt, ctx, meter = _call(Backend("b", "http://b", tp=1, decode_clock=clock), (50.0, 1000.0))
    _measure(rt, ctx, 30.0, 100, 4)
    prefill = 1000 * PRIOR[1].prefill_s_per_token
    assert _ratios(meter) == [pytest.approx((30.0 - prefill) / 100 / STEP_S)]


def test_without_an_engine_clock_or_for_a_stream_the_gateway_times_the_call() -> None:
    rt, ctx, meter = _call(Backend("b", "http://b", tp=1), None)
    _measure(rt, ctx, 30.0, 100, 4)  # the whole call less the profile's prefill estimate
    prefill = 1000 * PRIOR[1].prefill_s_per_token
    assert _ratios(meter) == [pytest.approx((30.0 - prefill) / 100 / STEP_S)]
    clocked = Backend("b", "http://b", tp=1, decode_clock=(60.0, 2000.0))
    rt, ctx, meter = _call(clocked, (50.0, 1000.0), stream=True)
    ctx.first_byte = 110.0  # 10 s to the first byte, then 99 tokens in 20 s
    _measure(rt, ctx, 30.0, 100, 4)
    assert _ratios(meter) == [pytest.approx(20.0 / 99 / STEP_S, rel=1e-3)]


def test_the_clock_is_read_from_vllms_inter_token_latency_or_its_older_name() -> None:
    new = """# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 40.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.2
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_count{model_name="m"} 4.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.2
"""
    assert parse_vllm_metrics(new).decode_clock == (pytest.approx(1.2), 40.0)
    old = new[new.index("# TYPE vllm:time_per_output"):]
    assert parse_vllm_metrics(old).decode_clock == (pytest.approx(0.2), 4.0)
    assert parse_vllm_metrics("# TYPE vllm:num_requests_running gauge\n"
                              "vllm:num_requests_running 1.0\n").decode_clock is None


def test_each_scrape_keeps_the_engines_time_per_token_since_the_one_before() -> None:
    b = Backend("b", "http://b", tp=1)
    b.read_decode_clock((10.0, 500.0))
    assert b.decode_clock == (10.0, 500.0) and b.engine_step_s is None  # one scrape: no span
    b.read_decode_clock((12.0, 600.0))
    assert b.engine_step_s == pytest.approx(0.02)
    b.read_decode_clock((12.0, 600.0))  # idle meanwhile: the last span it decoded in stands
    assert b.engine_step_s == pytest.approx(0.02)
    b.read_decode_clock((0.5, 20.0))  # restarted: nothing known of the new engine yet
    assert b.engine_step_s is None and b.decode_clock == (0.5, 20.0)
