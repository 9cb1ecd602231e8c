"""A call that waits out ``DISPATCH__QUEUE_TIMEOUT_S`` in the gateway's queue was never
seen by an engine: 503 ``queue_timeout`` with ``Retry-After`` (send it again as it was),
not an upstream timeout, and nothing is recorded for it."""

from __future__ import annotations

import threading
import time

import httpx

from gateway.config import DispatchSettings
from tests.scripted_upstream import Script

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}


def test_a_call_that_times_out_in_the_queue_is_503_and_not_recorded(scripted, gateway_at,
                                                                     sqlite_url):
    url, seen = scripted(Script(tokens=3, token_delay_s=0.7))
    dispatch = DispatchSettings(cap_per_gpu=1, queue_timeout_s=0.5, overload_retry_after_s=3)
    with gateway_at(sqlite_url, [url], dispatch=dispatch) as gw:
        running: list[httpx.Response] = []
        holder = threading.Thread(target=lambda: running.append(httpx.post(  # 2.1 s
            f"{gw}/t/holds-the-slot/v1/chat/completions", json={**CHAT, "stream": True},
            timeout=30)))
        holder.start()
        deadline = time.monotonic() + 10
        while not seen.bodies:  # the only slot is taken
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        r = httpx.post(f"{gw}/t/waits/v1/chat/completions", json=CHAT, timeout=30)
        waited = time.monotonic() - t0
        holder.join(30)

        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert err["code"] == "queue_timeout" and err["type"] == "overloaded_error", err
        assert "gateway queue" in err["message"]
        assert 0.5 <= waited < 1.5, waited  # well before the running call ended
        assert running[0].status_code == 200
        assert len(seen.bodies) == 1  # the engine never saw the queued call
        assert httpx.get(f"{gw}/trajectories/holds-the-slot").json()["calls"]
        waits = httpx.get(f"{gw}/trajectories/waits")
        assert waits.status_code == 404 or waits.json()["calls"] == [], waits.text
        status = httpx.get(f"{gw}/status").json()
        assert status["scheduler"]["queued"] == 0 and status["pool"]["running"] == 0
