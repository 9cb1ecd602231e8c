"""An engine's failure never reaches the client as the engine's own body: with every
attempt used (or an engine answering 501) the call is a 502 in its door's envelope, the
engine's message kept, streaming or not."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import Settings, TraceSettings, UpstreamSettings
from tests.scripted_upstream import Script

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "scripted", "prompt": "hi"}


def _settings(db_url: str, backends: list[str], max_attempts: int) -> Settings:
    return Settings(database_url=db_url, backends=backends, policy="slime",
                    upstream=UpstreamSettings(health_interval_s=0.5, max_attempts=max_attempts,
                                              breaker_failures=100),
                    traces=TraceSettings(flush_interval_s=0.05))


def _bad_gateway(r: httpx.Response, said: str) -> None:
    assert r.status_code == 502, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "bad_gateway" and err["code"] == "upstream_error", err
    assert said in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
def test_every_backend_answering_500_is_a_502_in_openai_shape(scripted, gateway, sqlite_url,
                                                                stream):
    ups = [scripted(Script(mode="error500")) for _ in range(3)]
    settings = _settings(sqlite_url, [url for url, _ in ups], max_attempts=3)
    with gateway(settings) as (url, _rt):
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream},
                       timeout=10)
        _bad_gateway(r, "upstream answered 500: boom")
        assert [len(seen.bodies) for _, seen in ups] == [1, 1, 1]  # every attempt used


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_page_that_is_not_json_is_a_502_in_openai_shape(scripted, gateway,
                                                                  sqlite_url, stream):
    up, _ = scripted(Script(mode="error500text", completions=True))
    with gateway(_settings(sqlite_url, [up], max_attempts=1)) as (url, _rt):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            r = httpx.post(url + path, json={**body, "stream": stream}, timeout=10)
            _bad_gateway(r, "upstream answered 500: Internal Server Error")


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_answering_501_is_a_502_in_each_doors_shape(scripted, gateway, sqlite_url,
                                                              stream):
    up, seen = scripted(Script(mode="error501", completions=True))
    with gateway(_settings(sqlite_url, [up], max_attempts=3)) as (url, _rt):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            r = httpx.post(url + path, json={**body, "stream": stream}, timeout=10)
            _bad_gateway(r, "upstream answered 501: logit_bias is not supported")
        assert len(seen.bodies) == 2  # a 501 is not retried
        r = httpx.post(f"{url}/v1/messages", json={**CHAT, "max_tokens": 5, "stream": stream},
                       timeout=10)
        assert r.status_code == 502, r.text
        assert r.json() == {"type": "error", "error": {
            "type": "api_error", "message": "logit_bias is not supported"}}
