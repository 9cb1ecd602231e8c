"""``/status``, ``/status/stream``, ``/metrics`` and the page assets, against a live gateway."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from tests.servers import app_in_thread
from tests.web.conftest import ADMIN_TOKEN, gateway_settings

AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


def _wait_for(pred, timeout=10.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def _chat(gw, traj, stream=False):
    r = httpx.post(f"{gw}/t/{traj}/v1/chat/completions", timeout=10, headers=AUTH, json={
        "model": "scripted", "stream": stream,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_status_json_has_the_page_data(scripted_gateway):
    gw, _ = scripted_gateway
    for _ in range(3):
        _chat(gw, "traj-a", stream=True)
        time.sleep(0.05)
    _chat(gw, "traj-b")
    httpx.post(f"{gw}/trajectories/traj-b/finish", json={"reward": 1.0}, headers=AUTH)
    status = _wait_for(lambda: (s := httpx.get(f"{gw}/status").json())["backends"][0]["engine"]
                       and len(s["history"]["points"]) >= 2 and s)
    engine = status["backends"][0]["engine"]
    assert engine["kv_usage"] == 0.25 and engine["waiting"] == 1.0
    assert engine["prefix_hit_rate"] == 0.75
    assert status["pool"] == {"instances": 1, "routable": 1, "gpus": 1, "running": 0,
                              "queued": 0}
    assert status["trajectories"]["by_phase"] == {"queued": 0, "generating": 0, "tool": 1,
                                                  "finished": 1}
    assert status["totals"]["calls"] == 4 and status["totals"]["completion_tokens"] == 20
    assert status["lengths"]["count"] == 2 and status["lengths"]["max"] == 15
    rows = {r["id"]: r for r in status["gantt"]["rows"]}
    kinds = [seg[0] for seg in rows["traj-a"]["segments"]]
    assert kinds.count("llm") == 3 and kinds.count("tool") == 3  # the last one still open
    assert kinds[-1] == "tool" and rows["traj-a"]["segments"][-1][2] == status["gantt"]["now"]
    assert rows["traj-b"]["phase"] == "finished"
    assert status["policy"] == "replay"  # the default policy
    # what the page offers to switch to: what PUT /admin/policy accepts, no hidden-length one
    assert "progressive" in status["policies"] and "straggler-lane" in status["policies"]
    assert "progressive-oracle" not in status["policies"]
    # no managed pool: a proposal could only be refused, and the Gantt has no relayout band
    assert status["relayouts"]["applied"] == 0 and status["gantt"]["relayouts"] == []
    assert "completion_text" not in json.dumps(status)
    # the speeds the policy plans with: the profile's until a TP has enough measured calls
    speeds = status["speeds"]
    assert speeds["profile"] == "qwen3-14b/H100" and [r["tp"] for r in speeds["by_tp"]] == [
        1, 2, 4, 8]
    tp1 = speeds["by_tp"][0]
    assert tp1["source"] == "profile" and tp1["factor"] == 1.0 and tp1["calls"] == 4
    assert tp1["step_ms_1"] > speeds["by_tp"][3]["step_ms_1"]  # TP8 decodes faster alone


def test_admin_changes_show_up_as_events(scripted_gateway):
    gw, _ = scripted_gateway
    r = httpx.put(f"{gw}/admin/weight-version", json={"version": "step-9"},
                  headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 200
    events = _wait_for(lambda: httpx.get(f"{gw}/status").json()["events"])
    assert events[0]["kind"] == "weight_version" and events[0]["version"] == "step-9"
    assert {"seq", "ts", "kind", "message"} <= events[0].keys()


def test_stream_sends_status_events(scripted_gateway):
    gw, _ = scripted_gateway
    events = []
    with httpx.stream("GET", f"{gw}/status/stream", params={"interval": 0.25},
                      timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    break
    assert events[1]["server_time"] > events[0]["server_time"]
    assert events[0]["weight_version"] == "0"


def test_page_and_assets_are_served_from_this_origin(scripted_gateway):
    gw, _ = scripted_gateway
    page = httpx.get(f"{gw}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert {"/static/app.js", "/static/style.css", "/static/favicon.svg"} <= set(assets)
    for path in assets:
        r = httpx.get(f"{gw}{path}")
        assert r.status_code == 200 and r.content, path
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    for bad in ("/static/__init__.py", "/static/..%2fpyproject.toml", "/static/.hidden.js",
                "/static/missing.js"):
        assert httpx.get(f"{gw}{bad}").status_code == 404, bad


def _exposed_names(text):
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def test_grafana_dashboard_uses_only_exposed_metrics(scripted_gateway):
    gw, _ = scripted_gateway
    _chat(gw, "traj-m", stream=True)
    _wait_for(lambda: "rollout_gateway_backend_kv_cache_usage{" in httpx.get(f"{gw}/metrics").text)
    exposed = _exposed_names(httpx.get(f"{gw}/metrics").text)
    dashboards = sorted((ROOT / "grafana").glob("*.json"))
    assert dashboards
    for path in dashboards:
        exprs = [t["expr"] for panel in json.loads(path.read_text())["panels"]
                 for t in panel.get("targets", [])]
        used = {n for e in exprs for n in re.findall(r"\brollout_gateway_[a-z0-9_]+", e)}
        assert len(used) >= 15, path
        assert used <= exposed, (path.name, sorted(used - exposed))


def test_every_exposed_metric_is_documented(scripted_gateway):
    gw, _ = scripted_gateway
    _chat(gw, "traj-d")
    doc = (ROOT / "docs" / "status-page.md").read_text()
    families = {f.name for f in text_string_to_metric_families(httpx.get(f"{gw}/metrics").text)}
    families = {n for n in families if not n.endswith("_created")}  # client-library extras
    missing = sorted(n for n in families if n.startswith("rollout_gateway_") and n not in doc)
    assert not missing
    assert len(families) >= 20


def _stream_first(gw: str, headers: dict[str, str]) -> dict:
    with httpx.stream("GET", f"{gw}/status/stream", params={"interval": 0.25}, headers=headers,
                      timeout=10) as r:
        return next(json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: "))


def test_backend_urls_are_shown_to_the_operator_only(scripted_gateway, loop_thread,
                                                     sqlite_url):
    """An engine's dev-mode routes take no credential: its address is not public."""
    gw, _ = scripted_gateway
    for headers in ({}, {"authorization": "Bearer not-the-token"}):
        for status in (httpx.get(f"{gw}/status", headers=headers).json(),
                       _stream_first(gw, headers)):
            (row,) = status["backends"]
            assert "url" not in row and row["id"] == "b0", row
    for status in (httpx.get(f"{gw}/status", headers=AUTH).json(), _stream_first(gw, AUTH)):
        assert status["backends"][0]["url"].startswith("http://127.0.0.1:")
    # no credential configured (loopback only): every caller is the operator, as on /admin
    up = next(b["url"] for b in httpx.get(f"{gw}/admin/backends", headers=AUTH).json()["data"])
    settings = gateway_settings(sqlite_url, [up], admin_token=None)
    with app_in_thread(loop_thread, lambda: create_app(settings)) as open_gw:
        assert httpx.get(f"{open_gw}/status").json()["backends"][0]["url"] == up


def test_an_open_status_stream_does_not_hold_the_shutdown(sqlite_url):
    """The status page's event stream ends as soon as the gateway begins to shut down.
    uvicorn waits up to ``shutdown_grace_s`` for responses in progress, then cancels them
    with a traceback each: the demo, with a browser on its status page, ended on
    ``Exception in ASGI application`` after a 5 s wait (issue 44)."""
    import asyncio
    import logging
    from contextlib import suppress

    from bench.harness.hosting import free_port, serve_gateway
    from gateway.config import ServerSettings

    class Errors(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.seen: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.seen.append(record.getMessage())

    async def main() -> tuple[float, int]:
        settings = gateway_settings(sqlite_url, [], server=ServerSettings(
            host="127.0.0.1", port=free_port(), shutdown_grace_s=5))
        events: list[str] = []
        async with httpx.AsyncClient(timeout=30) as http:
            async with serve_gateway(settings) as gw:
                async def listen() -> None:
                    async with http.stream("GET", f"{gw}/status/stream",
                                           params={"interval": 0.25}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line)

                task = asyncio.create_task(listen())
                while len(events) < 2:
                    assert not task.done(), task
                    await asyncio.sleep(0.05)
                started = time.monotonic()
            took = time.monotonic() - started
            with suppress(httpx.HTTPError):  # the stream ends as a hung-up connection does
                await asyncio.wait_for(task, 5)
        return took, len(events)

    errors = Errors()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(errors)
    try:
        took, events = asyncio.run(main())
    finally:
        logger.removeHandler(errors)
    assert events >= 2
    assert took < 2.0, f"shutdown took {took:.1f} s with a status stream open"
    assert errors.seen == [], errors.seen
