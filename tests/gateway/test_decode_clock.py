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
    backend = Backend("b", "http://b", tp=1,
                      decode_clock=(50.0 + 2 * STEP_S * 400, 1000.0 + 400))
    rt, ctx, meter = _call(backend, (50.0, 1000.0))
    # 100 tokens in 30 s: mostly a wait behind other prefills, which the engine's clock
    # leaves out; it decoded 400 tokens at twice the profile's step meanwhile
    _measure(rt, ctx, 30.0, 100, 4)
    assert _ratios(meter) == [pytest.approx(2.0)]


def test_a_call_that_spans_no_scrape_is_timed_at_the_next() -> None:
    """Too short to span a scrape: the engine's time per token from its dispatch to the
    next scrape, the span that holds its own decode; the call is not timed whole (that
    would hold the host's time per call, which the engine's clock leaves out)."""
    backend = Backend("b", "http://b", tp=1, decode_clock=(50.0, 1000.0))
    rt, ctx, meter = _call(backend, (50.0, 1000.0))
    _measure(rt, ctx, 30.0, 100, 4)
    assert _ratios(meter) == []  # waits for the scrape
    backend.read_decode_clock((50.0 + 3 * STEP_S * 200, 1000.0 + 200))
    assert _ratios(meter) == [pytest.approx(3.0)]
    backend.read_decode_clock((60.0, 1300.0))
    assert len(_ratios(meter)) == 1  # once


@pytest.mark.parametrize("clock", [(50.0, 1000.0), (1.0, 10.0)], ids=["idle", "restarted"])
def test_a_scrape_with_nothing_to_time_drops_the_call(clock: tuple[float, float]) -> None:
    """The engine decoded nothing since the call's dispatch, or restarted (its counters
    went back): there is no span to time the call by, and it is not timed whole."""
    backend = Backend("b", "http://b", tp=1, decode_clock=(50.0, 1000.0))
    rt, ctx, meter = _call(backend, (50.0, 1000.0))
    _measure(rt, ctx, 30.0, 100, 4)
    backend.read_decode_clock(clock)
    assert _ratios(meter) == [] and not backend.clock_waiters


def test_without_an_engine_clock_or_for_a_stream_the_gateway_times_the_call() -> None:
    backend = Backend("b", "http://b", tp=1)
    rt, ctx, meter = _call(backend, None)
    _measure(rt, ctx, 30.0, 100, 4)  # not scraped yet: whether it keeps a clock is unknown
    assert _ratios(meter) == []
    backend.read_decode_clock(None)  # scraped: its metrics hold no decode clock
    prefill = 1000 * PRIOR[1].prefill_s_per_token  # the whole call less the profile's prefill
    assert _ratios(meter) == [pytest.approx((30.0 - prefill) / 100 / STEP_S)]
    clocked = Backend("b", "http://b", tp=1, decode_clock=(60.0, 2000.0))
    rt, ctx, meter = _call(clocked, (50.0, 1000.0), stream=True)
    ctx.first_byte = 110.0  # 10 s to the first byte, then 99 tokens in 20 s
    _measure(rt, ctx, 30.0, 100, 4)
    assert _ratios(meter) == [pytest.approx(20.0 / 99 / STEP_S, rel=1e-3)]


def test_a_call_dispatched_before_the_first_scrape_takes_the_span_after_it() -> None:
    """Its dispatch has no reading to start from (the counters since the engine started
    are not its span): the engine's time per token between the next two scrapes."""
    backend = Backend("b", "http://b", tp=1)
    rt, ctx, meter = _call(backend, None)
    _measure(rt, ctx, 30.0, 100, 4)
    backend.read_decode_clock((50.0, 1000.0))
    assert _ratios(meter) == []
    backend.read_decode_clock((50.0 + 1.5 * STEP_S * 100, 1100.0))
    assert _ratios(meter) == [pytest.approx(1.5)]


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


@pytest.mark.parametrize("answer", [404, 200], ids=["no metrics", "vllm metrics"])
async def test_a_scrape_says_whether_the_engine_keeps_a_clock(answer: int) -> None:
    """A backend without ``/metrics`` (a server that is not vLLM) is scraped as keeping no
    clock, so its calls are timed by the gateway; a vLLM engine's clock is read."""
    import aiohttp
    from aiohttp import web

    from bench.harness.hosting import free_port
    from gateway.pool.monitor import Monitor

    text = ("vllm:inter_token_latency_seconds_count 40.0\n"
            "vllm:inter_token_latency_seconds_sum 1.2\n")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(status=answer, text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    backend = Backend("b", f"http://127.0.0.1:{port}", tp=1)
    rt, ctx, meter = _call(backend, None)
    _measure(rt, ctx, 30.0, 100, 4)
    try:
        async with aiohttp.ClientSession() as session:
            await Monitor()._scrape(session, backend)
    finally:
        await runner.cleanup()
    assert backend.decode_clock == (None if answer == 404 else (pytest.approx(1.2), 40.0))
    assert len(_ratios(meter)) == (1 if answer == 404 else 0)  # timed whole where no clock
