"""The status page in real headless Chromium while an agent workload runs.

Debian's chromium driven by Playwright (``executable_path``; Playwright's own browser
builds cannot be downloaded here). Without chromium the test skips on a developer
machine and FAILS under CI, where ``scripts/setup-browser.sh`` must have installed it.
Screenshots go to ``artifacts/web/``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from gateway.app import create_app
from gateway.schema.mismatch import report_of
from tests.servers import LoopThread, app_in_thread
from tests.web.conftest import ADMIN_TOKEN, Workload, entered, gateway_settings, start_workload

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "web"
CHROMIUM = os.environ.get("ROLLOUT_GATEWAY_CHROMIUM") or shutil.which("chromium") or \
    "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _unavailable(reason: str) -> None:
    message = f"{reason}; run scripts/setup-browser.sh and `pip install -e .[dev]`"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture
def browser(sqlite_url: str) -> Iterator[Any]:
    """Chromium, launched after the migrated database: Playwright's sync API keeps an event
    loop running in this thread, where ``asyncio.run`` (Alembic) no longer works."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed")
    if not Path(CHROMIUM).is_file():
        _unavailable(f"chromium not found at {CHROMIUM}")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def busy_gateway(loop_thread: LoopThread, sqlite_url: str) -> Iterator[tuple[str, Workload]]:
    """Three simulated vLLM servers (TP 1, 1, 2) behind a gateway, agents running."""
    configs = [SimServerConfig(model="qwen3-14b", tp=tp, speed=2.0, seed=i)
               for i, tp in enumerate((1, 1, 2))]
    with entered(loop_thread, start_sim_servers(configs)) as urls:
        backends = [f"{u}#tp={c.tp}" for u, c in zip(urls, configs, strict=True)]
        settings = gateway_settings(sqlite_url, backends)
        with app_in_thread(loop_thread, lambda: create_app(settings)) as gw:
            workload = Workload(gw, model="qwen3-14b", trajectories=48, turns=(4, 16))
            running = start_workload(loop_thread, workload)
            try:
                yield gw, workload
            finally:
                running.cancel()


def _watch_console(page: Any, errors: list[str]) -> None:
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error"
            else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}")
            if "/status/stream" not in r.url else None)


def _text(page: Any, selector: str) -> str:
    return str(page.locator(selector).text_content() or "")


def _expect_header(page: Any, gw: str, *, paused: bool) -> None:
    """The header's badges as a person sees them: the connection pill, and the "paused"
    pill only while the gateway is paused (``/status`` says the same)."""
    from playwright.sync_api import expect

    badge = page.locator("#paused")
    if paused:
        expect(badge).to_be_visible(timeout=5_000)
        expect(badge).to_have_text("paused")
    else:
        expect(badge).to_be_hidden(timeout=5_000)
    expect(page.locator("#conn")).to_have_text("live")
    shown = page.evaluate("() => [...document.querySelectorAll('header .pill')]"
                          ".filter(e => e.offsetParent !== null).map(e => e.textContent)")
    assert shown == (["live", "paused"] if paused else ["live"]), shown
    assert httpx.get(f"{gw}/status").json()["paused"] is paused


def test_status_page_is_live_and_usable(browser, busy_gateway):
    from playwright.sync_api import expect

    gw, workload = busy_gateway
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    _watch_console(page, errors)
    page.goto(f"{gw}/")
    expect(page.locator("#conn")).to_have_text("live", timeout=15_000)

    _expect_header(page, gw, paused=False)  # serving, not paused: no "paused" badge

    # Live numbers change without a reload.
    calls_before = _text(page, "#kpi-calls-total")
    page.wait_for_function(
        "before => document.getElementById('kpi-calls-total').textContent !== before",
        arg=calls_before, timeout=20_000)
    expect(page.locator("#pool tbody tr")).to_have_count(3)
    expect(page.locator("#speeds tbody tr")).to_have_count(4)  # TP1..8, with their source
    expect(page.locator("#speeds-profile")).to_contain_text("profile ")
    expect(page.locator("#speeds tr[data-tp='8'] td.source")).not_to_be_empty()
    expect(page.locator("#gantt .row").first).to_be_visible(timeout=15_000)
    page.wait_for_function("() => document.querySelectorAll('#pool .meter').length === 3",
                           timeout=15_000)  # KV use scraped from each vLLM /metrics
    page.wait_for_function("() => document.querySelectorAll('#throughput path.line').length",
                           timeout=15_000)
    page.wait_for_timeout(4_000)  # let the run build some history for the screenshot
    page.screenshot(path=str(ARTIFACTS / "status-1280x800.png"), full_page=True)
    page.screenshot(path=str(ARTIFACTS / "status-1280x800-fold.png"))

    # Admin action without the token is refused; with it, it takes effect.
    page.fill("#weights-value", "step-42")
    page.click("#weights-form button[type=submit]")
    # (generous timeouts: the suite runs on two workers, and this page shares the CPUs)
    expect(page.locator("#admin-result")).to_contain_text("rejected", timeout=15_000)
    page.fill("#admin-token", ADMIN_TOKEN)
    page.click("#token-form button[type=submit]")
    expect(page.locator("#admin-state")).to_have_text("token set for this tab")
    page.click("#weights-form button[type=submit]")
    expect(page.locator("#admin-result")).to_contain_text("step-42", timeout=15_000)
    expect(page.locator("#weight-version")).to_have_text("step-42", timeout=15_000)
    # the models table: each policy with its version (here the one served model's)
    expect(page.locator("#models tbody tr td.version").first).to_have_text("step-42",
                                                                           timeout=15_000)
    assert httpx.get(f"{gw}/status").json()["weight_version"] == "step-42"
    # (listed among the newest events; migrations may land between it and the top)
    expect(page.locator("#events li", has_text="weight version").first).to_be_visible(
        timeout=5_000)

    # The policy form offers the names the gateway accepts, and a switch takes effect.
    offered = page.eval_on_selector_all("#policy-names option", "els => els.map(e => e.value)")
    assert "straggler-lane" in offered and "verl" in offered, offered
    assert "progressive-oracle" not in offered and "least-loaded" not in offered, offered
    page.fill("#policy-name", "verl")
    page.click("#policy-form button[type=submit]")
    expect(page.locator("#policy")).to_have_text("verl", timeout=5_000)

    # A trajectory's calls open from the Gantt; with the admin token its text is shown.
    page.locator("#gantt .row").first.click()
    expect(page.locator("#traj-calls tbody tr").first).to_be_visible(timeout=5_000)
    page.locator("#traj-text details").first.click()
    expect(page.locator("#traj-text pre").first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "trajectory-dialog.png"))
    page.click("#traj-close")

    # The header says what is true: paused for a weight sync, then serving again.
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    # A trainer's mismatch reports show per step and version; one past a limit in red.
    expect(page.locator("#mismatch-empty")).to_be_visible()
    for step, gap in ((1, 0.001), (2, 0.4)):
        engine = np.log(np.linspace(0.1, 0.9, 64))
        report = report_of({"7": ([*(engine + gap)], [*engine])}, mode="async", step=step)
        r = httpx.post(f"{gw}/training/mismatch", headers=admin,
                       json=report.model_dump(mode="json"))
        assert r.status_code == 200, r.text
    expect(page.locator("#mismatch tbody tr")).to_have_count(2, timeout=5_000)
    expect(page.locator("#mismatch-empty")).to_be_hidden()
    expect(page.locator("#mismatch tr.bad[data-step='2'] td.alarm")).to_contain_text("KL")
    expect(page.locator("#mismatch tr[data-step='1'] td.alarm")).to_have_text("\u2013")
    expect(page.locator("#mismatch-summary")).to_contain_text("2 reports, 1 alarms")
    page.locator("#mismatch-card").screenshot(path=str(ARTIFACTS / "mismatch-card.png"))
    expect(page.locator("#events li", has_text="mismatch alarm").first).to_be_visible(
        timeout=5_000)
    assert httpx.post(f"{gw}/admin/pause", headers=admin, json={}).status_code == 200
    _expect_header(page, gw, paused=True)
    page.screenshot(path=str(ARTIFACTS / "status-paused-header.png"))
    assert httpx.post(f"{gw}/admin/resume", headers=admin).status_code == 200
    _expect_header(page, gw, paused=False)

    # Narrow screen: one column, nothing wider than the viewport.
    narrow = browser.new_page(viewport={"width": 390, "height": 844}, device_scale_factor=2,
                              is_mobile=True, has_touch=True)
    _watch_console(narrow, errors)
    narrow.goto(f"{gw}/")
    expect(narrow.locator("#conn")).to_have_text("live", timeout=15_000)
    expect(narrow.locator("#gantt .row").first).to_be_visible(timeout=15_000)
    overflow = narrow.evaluate("() => document.documentElement.scrollWidth - innerWidth")
    assert overflow <= 0, f"page is {overflow}px wider than a 390px screen"
    for card in ("#pool-card", "#gantt-card", "#mismatch-card", "#admin-card"):
        box = narrow.locator(card).bounding_box()
        assert box is not None and box["width"] <= 390, card
    narrow.screenshot(path=str(ARTIFACTS / "status-390x844.png"), full_page=True)

    page.close()
    narrow.close()
    expected = "console: Failed to load resource: the server responded with a status of 401"
    assert sum(e.startswith(expected) for e in errors) == 1  # the refused action above
    assert not [e for e in errors if not e.startswith(expected)], errors
    assert not workload.errors, workload.errors[:3]


def test_page_shows_a_relayout_the_policy_applied(browser, loop_thread: LoopThread,
                                                  sqlite_url: str, tmp_path: Path):
    """``progressive`` on a managed 4 x TP1 sim pool merges instances for the tail (as in
    tests/bench/test_live_relayout.py); the pool card counts it and the Gantt shades it."""
    from playwright.sync_api import expect

    from bench.harness.batch import HarnessConfig, run_batch
    from bench.harness.hosting import sim_pool_spec
    from bench.workloads import generate
    from gateway.config import DispatchSettings

    speed = 40.0
    spec = sim_pool_spec(tmp_path / "pool.json", [1, 1, 1, 1], model="qwen3-14b", gpu="H100",
                         speed=speed, seed=1)
    # no token: the emulated harnesses send no key (loopback, zero setup)
    settings = gateway_settings(sqlite_url, [], admin_token=None, pool=spec, policy="progressive",
                                dispatch=DispatchSettings(tick_s=0.05, time_scale=speed))
    specs = generate("swe", 1, prompts=2, group_size=4, max_context=32768)
    with app_in_thread(loop_thread, lambda: create_app(settings)) as gw:
        batch = loop_thread.run(run_batch(specs, HarnessConfig(
            gw, "qwen3-14b", speed=speed, seed=1, stream=False, reward_latency=False)), 120)
        assert batch.errors == 0
        rl = httpx.get(f"{gw}/status").json()["relayouts"]
        assert rl["applied"] >= 1
        errors: list[str] = []
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        _watch_console(page, errors)
        page.goto(f"{gw}/")
        expect(page.locator("#conn")).to_have_text("live", timeout=15_000)
        expect(page.locator("#pool-summary")).to_contain_text(
            f"relayouts {rl['applied']} applied of {rl['proposed']} proposed", timeout=10_000)
        expect(page.locator("#gantt rect.relayout")).to_have_count(rl["applied"])
        title = page.locator("#gantt rect.relayout title").first.text_content() or ""
        assert re.match(r"relayout tp1-g\d\+tp1-g\d.* -> TP\d: ", title), title
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.locator("#gantt-card").screenshot(path=str(ARTIFACTS / "gantt-relayout.png"))
        page.close()
    assert errors == []


ATTACK_PAGE = """<!doctype html><title>a page the operator happens to open</title><script>
const gw = "{gw}";
const tries = [
  fetch(gw + "/admin/pause", {{method: "POST", mode: "no-cors", body: "{{}}",
                              headers: {{"Content-Type": "text/plain"}}}}),
  fetch(gw + "/admin/weight-version", {{method: "PUT", mode: "no-cors",
                                       body: '{{"version": "pwned"}}'}}),
  fetch(gw + "/trajectories/t1/finish", {{method: "POST", mode: "no-cors",
                                         body: '{{"reward": 1}}',
                                         headers: {{"Content-Type": "text/plain"}}}}),
];
Promise.allSettled(tries).then(() => {{
  const form = Object.assign(document.createElement("form"),
                             {{method: "POST", action: gw + "/admin/pause",
                              enctype: "text/plain", target: "sink"}});
  document.body.append(Object.assign(document.createElement("iframe"), {{name: "sink"}}), form);
  form.submit();
  document.title = "sent";
}});
</script>"""


def test_a_foreign_page_cannot_drive_an_open_loopback_gateway(loop_thread: LoopThread,
                                                              sqlite_url: str):
    """The default gateway (loopback, no token) opened to a web page: cross-site fetches
    and a form post (simple requests, no preflight) change nothing, and a name re-pointed
    at 127.0.0.1 (DNS rebinding, via Chromium's resolver rules) is not served."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed")
    if not Path(CHROMIUM).is_file():
        _unavailable(f"chromium not found at {CHROMIUM}")
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    from tests.scripted_upstream import Script, Seen, make_upstream

    with app_in_thread(loop_thread, lambda: make_upstream(Script(), Seen())) as up, \
            app_in_thread(loop_thread, lambda: create_app(
                gateway_settings(sqlite_url, [up], admin_token=None))) as gw:
        attacker = Starlette(routes=[Route("/", lambda _: HTMLResponse(
            ATTACK_PAGE.format(gw=gw)))])
        with app_in_thread(loop_thread, lambda: attacker) as evil, sync_playwright() as pw:
            port = gw.rsplit(":", 1)[1]
            b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                *CHROMIUM_ARGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"])
            page = b.new_page()
            page.goto(evil)
            page.wait_for_function("() => document.title === 'sent'", timeout=10_000)
            page.wait_for_timeout(500)  # the form post lands in the iframe
            status = httpx.get(f"{gw}/status").json()
            assert status["paused"] is False and status["weight_version"] == "0"
            assert httpx.get(f"{gw}/trajectories/t1").status_code == 404  # never finished
            for path in ("/", "/status", "/trajectories"):
                answer = page.goto(f"http://rebind.test:{port}{path}")
                assert answer is not None and answer.status == 400, path
                assert "DNS rebinding" in (page.content() or "")
            # the page itself, on its own origin, still drives the gateway
            page.goto(f"{gw}/")
            page.fill("#weights-value", "step-7")
            page.click("#weights-form button[type=submit]")
            page.wait_for_function(
                "() => document.getElementById('weight-version').textContent === 'step-7'",
                timeout=5_000)
            b.close()
