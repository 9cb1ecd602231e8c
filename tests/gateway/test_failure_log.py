"""A failed call leaves one line in the gateway's log (trajectory, door, status, reason):
WARNING for a 5xx, INFO for a 4xx; repeats are rate-limited with a count of what was held
back (gateway/failure_log.py). Through a real gateway and scripted upstreams."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from gateway.errors import UpstreamTimeout
from gateway.failure_log import FailureLog
from tests.scripted_upstream import Script

BODY = {"model": "scripted", "messages": [{"role": "user", "content": "x"}]}
LOGGER = "gateway.failure_log"


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_a_backend_failure_logs_one_warning(scripted, gateway_at, sqlite_url, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    url, _ = scripted(Script(mode="error500", error_message="engine exploded"))
    with gateway_at(sqlite_url, [url], upstream={"max_attempts": 1}) as gw:
        r = httpx.post(f"{gw}/t/traj-5xx/v1/chat/completions", json=BODY)
        assert r.status_code == 502, r.text
    (line,) = _lines(caplog)
    assert line[0] == logging.WARNING
    assert line[1].startswith("call failed: trajectory traj-5xx, door chat, status 502: "
                              "upstream answered 500"), line
    assert "engine exploded" in line[1]


def test_client_errors_log_at_info_and_repeats_are_held_back(scripted, gateway_at,
                                                             sqlite_url, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    url, _ = scripted(Script(mode="error400"))
    with gateway_at(sqlite_url, [url]) as gw:
        for _ in range(5):  # the same failure, five times in a row: one line
            r = httpx.post(f"{gw}/t/traj-4xx/v1/chat/completions", json=BODY)
            assert r.status_code == 400, r.text
        # refused before it became a call (the door cannot read it): logged all the same
        r = httpx.post(f"{gw}/t/traj-bad/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        r = httpx.post(f"{gw}/v1/messages", json={"model": "nope", "max_tokens": 5,
                                                  "messages": [{"role": "user",
                                                                "content": "x"}]})
        assert r.status_code == 404, r.text
    lines = _lines(caplog)
    assert [lvl for lvl, _ in lines] == [logging.INFO] * 3, lines
    assert lines[0][1].startswith("call failed: trajectory traj-4xx, door chat, status 400: "
                                  "upstream answered 400"), lines
    assert lines[1][1].startswith("call failed: trajectory traj-bad, door completions, "
                                  "status 400"), lines  # another door: not held back
    assert "door messages, status 404" in lines[2][1] and "trajectory -," in lines[2][1]


async def test_a_client_that_leaves_is_logged_as_499(scripted, gateway_at, sqlite_url,
                                                     caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    url, _ = scripted(Script(mode="hang"))
    with gateway_at(sqlite_url, [url]) as gw:
        async with httpx.AsyncClient(timeout=0.5) as http:
            with pytest.raises(httpx.TimeoutException):
                await http.post(f"{gw}/t/traj-left/v1/chat/completions", json=BODY)
        for _ in range(50):
            if _lines(caplog):
                break
            await asyncio.sleep(0.05)
    assert _lines(caplog) == [(logging.INFO, "call failed: trajectory traj-left, door chat, "
                                             "status 499: client disconnected")]


def test_repeats_are_counted_not_silenced(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    now = [0.0]
    failures = FailureLog(every_s=10.0, clock=lambda: now[0])
    timeout = UpstreamTimeout("no first byte within 30 s")
    for t in range(12):  # one a second: the first logs, the next nine are held back
        now[0] = float(t)
        failures.failed(f"t{t}", "responses", timeout)
    failures.failed("other", "chat", timeout)  # another door: its own line at once
    lines = _lines(caplog)
    assert [m for _, m in lines] == [
        "call failed: trajectory t0, door responses, status 504: no first byte within 30 s",
        "call failed: trajectory t10, door responses, status 504: no first byte within "
        "30 s (9 more 504 on responses held back since the last line)",
        "call failed: trajectory other, door chat, status 504: no first byte within 30 s"]
    assert {lvl for lvl, _ in lines} == {logging.WARNING}
    failures.failed("a\nb", "chat", ValueError("x"))  # an id never validated: quoted
    assert _lines(caplog)[-1][1] == "call failed: trajectory 'a\\nb', door chat, status " \
        "500: ValueError: x"
