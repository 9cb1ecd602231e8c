"""Bad input stops at the door: a body nested deeper than ``SERVER__MAX_JSON_DEPTH`` or a
model name longer than a record holds is a 400 in the door's envelope, before anything is
queued; what an engine says that is longer than its column is cut where the record is made,
so every answered call is stored (on Postgres, one value too long loses the whole batch)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.config import ServerSettings, Settings, TraceSettings, UpstreamSettings
from gateway.proxy.bodies import json_depth
from tests.scripted_upstream import Script

LIMIT = 64


def _nest(levels: int) -> Any:
    """``levels`` objects inside each other (orjson's encoder stops at 255)."""
    value: Any = "deep"
    for _ in range(levels):
        value = {"k": value}
    return value


def _chat(extra: Any = None, **kw: Any) -> dict[str, Any]:
    message = {"role": "user", "content": "hi", **({"x": extra} if extra is not None else {})}
    return {"model": "scripted", "messages": [message], **kw}


def _tools(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.fixture
def gw(scripted, gateway, db_url):
    script = Script()
    upstream, seen = scripted(script)
    settings = Settings(database_url=db_url, backends=[upstream], policy="slime",
                        model_aliases={"claude-*": "scripted"},
                        server=ServerSettings(max_json_depth=LIMIT),
                        upstream=UpstreamSettings(health_interval_s=0.5, max_attempts=1),
                        traces=TraceSettings(flush_interval_s=0.05))
    with gateway(settings) as (url, rt):
        yield url, rt, seen, script


def _openai_400(r: httpx.Response, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return str(err["message"])


def test_nesting_past_the_limit_is_a_400_in_each_doors_envelope(gw):
    url, rt, seen, _ = gw
    too_deep = [
        ("/v1/chat/completions", _chat(_nest(300))),
        ("/v1/chat/completions", _chat(tools=_tools(_nest(300)))),
        ("/v1/chat/completions", _chat(_nest(LIMIT - 2))),  # one level past the limit
        ("/t/deep-1/v1/chat/completions", _chat(_nest(300))),
        ("/v1/completions", {"model": "scripted", "prompt": "hi", "x": _nest(300)}),
        ("/v1/responses", {"model": "scripted", "input": "hi", "tools": _tools(_nest(300))}),
    ]
    for path, body in too_deep:
        message = _openai_400(httpx.post(url + path, json=body, timeout=10))
        assert f"deeper than {LIMIT} levels" in message and "MAX_JSON_DEPTH" in message
    r = httpx.post(f"{url}/v1/messages", timeout=10, json={
        "model": "scripted", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi", "x": _nest(300)}]})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "MAX_JSON_DEPTH" in r.json()["error"]["message"]
    assert seen.bodies == []  # none reached the engine
    assert all(st.in_flight == 0 and st.queued == 0 for st in rt.tracker)


def test_nesting_at_the_limit_is_served_and_stored(gw):
    url, rt, seen, _ = gw
    body = _chat(_nest(LIMIT - 3), tools=_tools(_nest(LIMIT - 5)))
    assert json_depth(body, stop_after=LIMIT) == LIMIT
    r = httpx.post(f"{url}/t/deep-ok/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert seen.bodies[0]["messages"][0]["x"] == _nest(LIMIT - 3)
    detail = httpx.get(f"{url}/trajectories/deep-ok", params={"include_text": "true"}).json()
    assert detail["calls"][0]["request_messages"][0]["x"] == _nest(LIMIT - 3)
    assert rt.writer.running and rt.writer.rejected == 0


def test_a_model_name_longer_than_a_record_holds_is_a_400_before_aliasing(gw):
    url, rt, seen, _ = gw
    for body in (_chat(model="claude-" + "x" * 293),  # a glob would map it
                 _chat(model="y" * 257)):
        message = _openai_400(httpx.post(f"{url}/v1/chat/completions", json=body), "model")
        assert "longer than 256 characters" in message
    assert seen.bodies == []
    longest = "claude-" + "x" * 249  # 256: the column's length, served through the alias
    r = httpx.post(f"{url}/t/long-model/v1/chat/completions", json=_chat(model=longest))
    assert r.status_code == 200, r.text
    (call,) = httpx.get(f"{url}/trajectories/long-model").json()["calls"]
    assert call["model"] == "scripted" and call["requested_model"] == longest
    assert rt.writer.rejected == 0


def test_an_engines_long_finish_reason_and_error_are_stored_cut(gw):
    url, rt, _, script = gw
    script.finish_reason = "f" * 100
    r = httpx.post(f"{url}/t/long-says/v1/chat/completions", json=_chat())
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "f" * 100
    script.mode, script.error_message = "error500", "e" * 5000
    r = httpx.post(f"{url}/t/long-says/v1/chat/completions", json=_chat(stream=True))
    assert r.status_code == 502, r.text
    ok, failed = httpx.get(f"{url}/trajectories/long-says").json()["calls"]
    assert ok["status"] == "ok" and ok["finish_reason"] == "f" * 32  # calls.finish_reason
    assert failed["status"] == "error" and failed["error"].startswith("upstream answered 500: e")
    assert len(failed["error"]) == 1000
    assert rt.writer.rejected == 0 and rt.writer.dropped == 0
