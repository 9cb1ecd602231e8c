"""One status page over every shard, in real headless Chromium: the front serves the page,
its merged ``/status`` and stream; the pool table lists every shard's instances, a
trajectory opens from the Gantt (the front finds its shard), an admin action taken on
the page reaches every shard, and the trajectory viewer works through the front: its
search box finds the trajectories every shard recorded, a trajectory page draws the
sample of whichever shard ran it, a group page holds members of both shards."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.shards.conftest import batch_ids, gateway, run_batch
from tests.web.test_browser import ARTIFACTS, browser  # noqa: F401 - the Chromium fixture

pytestmark = [pytest.mark.browser, pytest.mark.postgres]


def test_one_page_over_every_shard(browser: Any, sim_servers: list[str],  # noqa: F811
                                   tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with gateway(sim_servers[:4], 2, tmp_path) as (url, _):
        ids = batch_ids(groups=4, size=2)
        worker = threading.Thread(target=lambda: asyncio.run(run_batch(url, ids, turns=6)))
        worker.start()
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(f"{url}/")
        expect(page.locator("#conn")).to_have_text("live", timeout=15_000)
        expect(page.locator("#pool tbody tr")).to_have_count(4)
        ids_shown = page.eval_on_selector_all("#pool tbody tr", "rows => rows.map("
                                              "r => r.textContent)")
        assert any("s0/" in t for t in ids_shown) and any("s1/" in t for t in ids_shown)
        expect(page.locator("#gantt .row").first).to_be_visible(timeout=15_000)
        page.locator("#gantt .row").first.click()
        expect(page.locator("#traj-calls tbody tr").first).to_be_visible(timeout=10_000)
        page.click("#traj-close")
        page.fill("#weights-value", "21")
        page.click("#weights-form button[type=submit]")
        expect(page.locator("#weight-version")).to_have_text("21", timeout=10_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "status-sharded.png"), full_page=True)
        worker.join(120)
        shards = httpx.get(f"{url}/status", timeout=30).json()["shards"]
        assert [s["weight_version"] for s in shards] == ["21", "21"]

        page.fill("#quick-q", "grp-")
        page.click("#quick-search button")
        expect(page.locator("#search-table tbody tr")).to_have_count(8, timeout=15_000)
        owners = {t: httpx.get(f"{url}/trajectories/{t}/view", timeout=30).status_code
                  for ts in ids.values() for t in ts}
        assert set(owners.values()) == {200}
        page.locator("#search-table a", has_text="grp-1-1").click()
        expect(page.locator("#tokens .t").first).to_be_visible(timeout=15_000)
        assert "task of grp-1" in (page.locator("#tokens").text_content() or "")
        page.click("#traj-facts a")  # its group
        expect(page.locator("#group-table tbody tr")).to_have_count(2, timeout=15_000)
        page.screenshot(path=str(ARTIFACTS / "viewer-sharded-group.png"), full_page=True)
        page.close()
    assert not errors, errors
