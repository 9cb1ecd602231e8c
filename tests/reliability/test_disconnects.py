"""A client that leaves, before or after its first token, aborts the call at the engine
(counted at the simulated server's ``/sim/stats``) and releases every counter.

Extends tests/gateway/test_scripted.py (scripted upstream) and the acceptance test's
mid-stream case with the simulated engine's view and the gateway's accounting."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from gateway.config import Settings, TraceSettings, UpstreamSettings
from tests.reliability.conftest import MODEL

LONG = {"model": MODEL, "max_tokens": 4000, "ignore_eos": True,
        "messages": [{"role": "user", "content": "write a lot"}]}


def _wait(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(predicate())


def _leave(url: str, tid: str, how: str) -> None:
    target = f"{url}/t/{tid}/v1/chat/completions"
    if how == "non_stream":  # nothing reaches a non-streaming client before the end
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(target, json=LONG, timeout=0.5)
        return
    with httpx.stream("POST", target, json={**LONG, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        if how == "after_tokens":
            lines = r.iter_lines()
            got = 0
            while got < 5:
                got += next(lines).startswith("data: ")
        # "headers_only": leave as soon as the response starts, before any token


@pytest.mark.parametrize("how", ["headers_only", "non_stream", "after_tokens"])
def test_client_leaves_and_the_engine_aborts(gateway, sim_children, sqlite_url, how):
    sim = sim_children(speed=1)

    def stats() -> dict[str, int]:
        return httpx.get(f"{sim.url}/sim/stats").json()

    settings = Settings(database_url=sqlite_url, backends=[sim.url],
                        upstream=UpstreamSettings(health_interval_s=0.2),
                        traces=TraceSettings(flush_interval_s=0.05))
    with gateway(settings) as (url, rt):
        tid = f"leave-{how}"
        _leave(url, tid, how)
        assert _wait(lambda: stats()["disconnects"] == 1), stats()
        assert _wait(lambda: stats()["running"] == 0 and stats()["waiting"] == 0)
        assert _wait(lambda: all(b.in_flight == 0 for b in rt.registry))
        st = rt.tracker.get(tid)
        assert st is not None and st.in_flight == 0 and st.queued == 0
        metrics = httpx.get(f"{url}/metrics").text
        assert "rollout_gateway_calls_in_flight 0.0" in metrics
        calls = httpx.get(f"{url}/trajectories/{tid}").json()["calls"]
        assert [c["status"] for c in calls] == ["cancelled"]
        if how == "after_tokens":
            assert len(calls[0]["completion_ids"]) >= 4  # what was generated is kept
        # and the trajectory's next call is served normally
        r = httpx.post(f"{url}/t/{tid}/v1/chat/completions", timeout=30,
                       json={**LONG, "max_tokens": 3})
        assert r.status_code == 200
