"""Malformed requests get a clear 4xx in their route's wire shape, never reach a backend
and leave nothing half-written; odd but valid unicode passes through intact."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import Settings, TraceSettings, UpstreamSettings
from tests.scripted_upstream import Script

MSG = [{"role": "user", "content": "x"}]
CHAT = "/v1/chat/completions"
BAD_V1 = [  # (path, raw body, status, param)
    (CHAT, b"{nope", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, b"\xff\xfe\x00", 400, None),
    (CHAT, b'[{"model": "scripted"}]', 400, None),
    (CHAT, b'"just a string"', 400, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
    (CHAT, b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', 400, "model"),
    (CHAT, b'{"model": "", "messages": [{"role": "user", "content": "x"}]}', 400, "model"),
    (CHAT, b'{"model": "scripted"}', 400, "messages"),
    (CHAT, b'{"model": "scripted", "messages": []}', 400, "messages"),
    (CHAT, b'{"model": "scripted", "messages": "hi"}', 400, "messages"),
    (CHAT, b'{"model": "scripted", "messages": [1, 2]}', 400, "messages"),
    (CHAT, b'{"model": "scripted", "messages": [{"role": "user"}], "stream": "yes"}', 400,
     "stream"),
    (CHAT, b'{"model": "scripted", "messages": [{"role": "user"}], "n": 0}', 400, "n"),
    (CHAT, b'{"model": "scripted", "messages": [{"role": "user"}], "n": true}', 400, "n"),
    (CHAT, b'{"model": "scripted", "messages": [{"role": "user", "content": "\\ud800"}]}',
     400, None),  # a lone surrogate is not text
    ("/v1/completions", b'{"model": "scripted"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "scripted", "prompt": 5}', 400, "prompt"),
    (CHAT, b'{"model": "gpt-nope", "messages": [{"role": "user"}]}', 404, "model"),
    ("/t/bad id!/v1/chat/completions", b'{"model": "scripted", "messages": []}', 400, None),
    ("/t/" + "a" * 200 + CHAT, b'{"model": "scripted", "messages": []}', 400, None),
    ("/t/caf%C3%A9" + CHAT, b'{"model": "scripted", "messages": []}', 400, None),
    ("/t/%00x" + CHAT, b'{"model": "scripted", "messages": []}', 400, None),
    ("/g/ok/t/%F0%9F%98%80" + CHAT, b'{"model": "scripted", "messages": []}', 400, None),
]
BAD_HEADERS = [{"x-trajectory-id": "no spaces allowed"}, {"x-trajectory-id": "x" * 300},
               {"x-group-id": "bad/group"}, {"x-trajectory-id": "-leading-dash"}]


@pytest.fixture
def gw(scripted, gateway, sqlite_url):
    upstream, seen = scripted(Script())
    settings = Settings(database_url=sqlite_url, backends=[upstream], policy="slime",
                        upstream=UpstreamSettings(health_interval_s=0.5),
                        traces=TraceSettings(flush_interval_s=0.05))
    with gateway(settings) as (url, rt):
        yield url, rt, seen


def test_bad_openai_requests_get_4xx_in_openai_shape(gw):
    url, rt, seen = gw
    for path, raw, status, param in BAD_V1:
        r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, (path, raw, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == ("invalid_request_error" if status == 400 else err["type"])
        assert err["message"]
        if param is not None:
            assert err["param"] == param, (raw, err)
    for headers in BAD_HEADERS:
        r = httpx.post(url + CHAT, json={"model": "scripted", "messages": MSG}, headers=headers)
        assert r.status_code == 400, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_trajectory_id"
    assert seen.bodies == []  # nothing reached the backend
    assert rt.writer.written == 0 and rt.writer.queue_depth == 0
    assert httpx.get(f"{url}/trajectories").json()["data"] == []  # nothing half-written
    assert all(st.in_flight == 0 and st.queued == 0 for st in rt.tracker)


def test_bad_requests_elsewhere_get_detail_shape(gw):
    url, _, _ = gw
    cases = [
        ("POST", "/trajectories/t1/finish", b"{nope", 422),
        ("POST", "/trajectories/t1/finish", b'{"reward": "lots"}', 422),
        ("POST", "/trajectories/t1/finish",
         b'{"reward": 1, "metadata": [{"n": -32589158477190044730}]}', 422),
        ("GET", "/trajectories?limit=abc", None, 422),
        ("GET", "/trajectories?limit=0", None, 422),
        ("GET", "/trajectories/bad%20id", None, 400),
        ("GET", "/trajectories/%F0%9F%98%80", None, 400),
        ("GET", "/trajectories/never-seen", None, 404),
        ("PUT", "/admin/weight-version", b'{"version": ["x"]}', 422),
    ]
    for method, path, raw, status in cases:
        r = httpx.request(method, url + path, content=raw,
                          headers={"content-type": "application/json"})
        assert r.status_code == status, (method, path, r.text)
        assert set(r.json()) == {"detail"}, r.text


def test_odd_but_valid_unicode_passes_through_intact(scripted, gateway, db_url):
    upstream, seen = scripted(Script())
    settings = Settings(database_url=db_url, backends=[upstream], policy="slime",
                        upstream=UpstreamSettings(health_interval_s=0.5),
                        traces=TraceSettings(flush_interval_s=0.05))
    with gateway(settings) as (url, rt):
        _unicode_round_trip(url, seen)
        assert rt.writer.rejected == 0 and rt.writer.dropped == 0


def _unicode_round_trip(url, seen):
    text = "RTL \u202e mixed \U0001f600 zero\u200bwidth, NUL \u0000, astral \U00010348, \ufeff"
    r = httpx.post(f"{url}/t/uni-1/v1/chat/completions",
                   json={"model": "scripted", "messages": [{"role": "user", "content": text}],
                         "user": "\u00e9l\u00e8ve"})
    assert r.status_code == 200, r.text
    assert seen.bodies[0]["messages"][0]["content"] == text
    detail = httpx.get(f"{url}/trajectories/uni-1", params={"include_text": "true"}).json()
    assert detail["calls"][0]["request_messages"][0]["content"] == text
