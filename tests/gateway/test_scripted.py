"""Proxy behaviour against scripted upstreams: capture, stripping, retries, timeouts."""

from __future__ import annotations

import contextlib
import time

import httpx
import orjson

from tests.scripted_upstream import Script


def test_non_streaming_strips_injected_fields(scripted, gateway_at, sqlite_url):
    url, seen = scripted(Script())
    with gateway_at(sqlite_url, [url]) as gw:
        r = httpx.post(f"{gw}/t/traj-1/v1/chat/completions",
                       json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}],
                             "vendor_field": {"keep": 1}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert "prompt_token_ids" not in body
        assert "token_ids" not in body["choices"][0]
        assert body["choices"][0]["logprobs"] is None
        assert r.headers["x-trajectory-id"] == "traj-1"
        sent = seen.bodies[0]
        assert sent["return_token_ids"] is True and sent["logprobs"] is True
        assert sent["vendor_field"] == {"keep": 1}
        detail = httpx.get(f"{gw}/trajectories/traj-1").json()
        assert detail["calls"][0]["completion_ids"] == [1000, 1001, 1002, 1003, 1004]
        assert detail["calls"][0]["completion_logprobs"] == [-0.5] * 5


def test_retry_on_5xx_goes_to_another_backend(scripted, gateway_at, sqlite_url):
    bad, bad_seen = scripted(Script(mode="error500"))
    good, good_seen = scripted(Script())
    with gateway_at(sqlite_url, [bad, good]) as gw:
        for _ in range(4):
            r = httpx.post(f"{gw}/v1/chat/completions",
                           json={"model": "scripted", "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200, r.text
        assert len(good_seen.bodies) == 4


def test_first_byte_timeout_gives_504(scripted, gateway_at, sqlite_url):
    url, _ = scripted(Script(mode="hang"))
    with gateway_at(sqlite_url, [url], upstream={"first_byte_timeout_s": 0.5}) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", timeout=10,
                       json={"model": "scripted", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_timeout"


def test_malformed_json_is_400_in_openai_shape(scripted, gateway_at, sqlite_url):
    url, seen = scripted(Script())
    with gateway_at(sqlite_url, [url]) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", content=b"{nope",
                       headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(f"{gw}/v1/chat/completions", json={"model": "nope", "messages": [
            {"role": "user", "content": "x"}]})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(f"{gw}/t/bad id!/v1/chat/completions", json={"model": "scripted"})
        assert r.status_code == 400
        assert seen.bodies == []


def test_stream_relays_and_strips(scripted, gateway_at, sqlite_url):
    url, _ = scripted(Script(tokens=4))
    with gateway_at(sqlite_url, [url]) as gw:
        with httpx.stream("POST", f"{gw}/t/s-1/v1/chat/completions", json={
                "model": "scripted", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        payloads = [orjson.loads(e[6:]) for e in events if e != "data: [DONE]"]
        assert events[-1] == "data: [DONE]"
        assert all("prompt_token_ids" not in p for p in payloads)
        assert all("token_ids" not in c for p in payloads for c in p["choices"])
        calls = httpx.get(f"{gw}/trajectories/s-1").json()["calls"]
        assert calls[0]["completion_ids"] == [1000, 1001, 1002, 1003]
        assert calls[0]["ttft_ms"] is not None


def _wait_for(predicate, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_client_disconnect_mid_stream_closes_upstream(scripted, gateway_at, sqlite_url):
    url, seen = scripted(Script(tokens=200, token_delay_s=0.02))
    with gateway_at(sqlite_url, [url]) as gw:
        with httpx.stream("POST", f"{gw}/t/d-1/v1/chat/completions", json={
                "model": "scripted", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
        assert _wait_for(lambda: seen.closed_early == 1)
        assert seen.completed == 0
        status = httpx.get(f"{gw}/status").json()
        assert _wait_for(lambda: httpx.get(f"{gw}/status").json()["backends"][0]["in_flight"] == 0)
        calls = httpx.get(f"{gw}/trajectories/d-1").json()["calls"]
        assert calls[0]["status"] == "cancelled"
        assert status["trace_writer"]["dropped"] == 0


def test_client_disconnect_before_first_byte_closes_upstream(scripted, gateway_at, sqlite_url):
    url, seen = scripted(Script(mode="hang"))
    with gateway_at(sqlite_url, [url]) as gw:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{gw}/t/d-2/v1/chat/completions", timeout=0.5, json={
                "model": "scripted", "messages": [{"role": "user", "content": "hi"}]})
        assert _wait_for(lambda: httpx.get(f"{gw}/status").json()["backends"][0]["in_flight"] == 0)
        calls = httpx.get(f"{gw}/trajectories/d-2").json()["calls"]
        assert calls[0]["status"] == "cancelled"


def test_client_leaving_after_the_last_token_keeps_the_call(scripted, gateway_at, sqlite_url):
    """A harness that closes its stream once it has the finish (Codex after
    ``response.completed``) before the engine's stream ends: every token was generated
    and captured, so the call is recorded ok and its tokens reach the sample."""
    url, seen = scripted(Script(tail_delay_s=2.0))
    with gateway_at(sqlite_url, [url]) as gw:
        with httpx.stream("POST", f"{gw}/t/leaves/v1/chat/completions", timeout=10, json={
                "model": "scripted", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and any(
                        c.get("finish_reason") for c in orjson.loads(line[6:])["choices"]):
                    break  # the finish is here: leave without waiting for [DONE]
        for _ in range(100):
            calls = httpx.get(f"{gw}/trajectories/leaves").json().get("calls", [])
            if calls:
                break
            time.sleep(0.05)
        (call,) = calls
        assert call["status"] == "ok" and call["error"] is None, call
        assert call["completion_ids"] == [1000, 1001, 1002, 1003, 1004]
        sample = httpx.get(f"{gw}/trajectories/leaves/sample").json()
        assert sum(sample["loss_mask"]) == 5
