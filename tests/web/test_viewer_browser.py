"""The trajectory viewer in real headless Chromium, on a batch recorded from harnesses as
shipped: Claude Code (its Bash tool, a 13k-token first prompt), opencode (its title call
beside the agent: a side call) and mini-swe-agent (the replies it rejects and drops from
its history) in one GRPO group, through a gateway over the simulated engine.

Each page is read as a user reads it: the search finds the group's trajectories, a
trajectory page shows the branch tree with why each branch opened, the calls and their
timings, the sample's tokens decoded with their loss mask and logprobs (a hover says what
one token is), the harness's messages; the group page the advantages. Each page is held
to a layout at 1280 px: nothing wider than the window or its card, no text under 11 px;
screenshots go to ``artifacts/web/`` (docs/screenshots/ has the committed ones). A
second gateway with credentials shows each credential only what it may read.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.sim.chat import ToolCall
from backends.sim.state import SimServerConfig
from tests.harnesses.conftest import MODEL, logged_gateway, npm_cli
from tests.harnesses.mini import run_mini
from tests.harnesses.test_claude_code import ALIASES, BASH_CALL, run_claude
from tests.harnesses.test_opencode import run_opencode
from tests.servers import LoopThread
from tests.web.test_browser import ARTIFACTS, browser  # noqa: F401 - the Chromium fixture

pytestmark = pytest.mark.browser
GROUP = "viewer-" + uuid.uuid4().hex[:6]
WIDTH = 1280

#: what each page must hold to at WIDTH: nothing overflows the window, a card, a table's
#: frame or a fact's box (an ellipsis is text nobody can read), no visible text under 11 px
LAYOUT_JS = """() => {
  const bad = [];
  const de = document.documentElement;
  if (de.scrollWidth > de.clientWidth + 1) bad.push(`page ${de.scrollWidth} px wide`);
  const shown = (e) => e.offsetParent !== null || getComputedStyle(e).position === "fixed";
  for (const e of document.querySelectorAll(".card, .table-wrap, .tokens, .facts dd, .branch")) {
    if (shown(e) && e.scrollWidth > e.clientWidth + 1)
      bad.push(`${e.id || e.className} overflows: ${e.scrollWidth} > ${e.clientWidth}`);
  }
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walk.nextNode()) {
    const t = walk.currentNode, e = t.parentElement;
    if (!t.textContent.trim() || !e || !shown(e)) continue;
    const size = parseFloat(getComputedStyle(e).fontSize);
    if (size < 11) bad.push(`${size} px text: ${t.textContent.trim().slice(0, 40)}`);
  }
  return bad;
}"""


@pytest.fixture(scope="module")
def recorded(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, Any]]:
    """A gateway holding the batch: one Claude Code run, one opencode run and two
    mini-swe-agent runs in GROUP, each finished with a reward."""
    claude, opencode = npm_cli("claude", "Claude Code"), npm_cli("opencode", "opencode")
    tmp = tmp_path_factory.mktemp("runs")
    works = {name: tmp / f"{name}-work" for name in ("claude", "opencode")}
    for work in works.values():
        work.mkdir()
        (work / "proof.txt").write_text("the proof\n")
    read = ToolCall("read", json.dumps({"filePath": str(works["opencode"] / "proof.txt")}))
    cfg = SimServerConfig(model=MODEL, speed=50, seed=13, output_len_median=20,
                          tool_script=((BASH_CALL, read),))
    with logged_gateway(loop_thread, tmp_path_factory, cfg, model_aliases=ALIASES) as (gw, _):
        ids = {name: f"{GROUP}-{name}" for name in ("claude", "opencode", "mini-a", "mini-b")}
        proc = run_claude(claude, f"{gw}/g/{GROUP}/t/{ids['claude']}",
                          "Show me what proof.txt says.", tmp / "claude-home", works["claude"])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        run_opencode(opencode, f"{gw}/g/{GROUP}/t/{ids['opencode']}/v1", tmp / "oc-home",
                     works["opencode"])
        for name, steps in (("mini-a", 5), ("mini-b", 8)):
            (tmp / name).mkdir()
            run_mini(f"{gw}/g/{GROUP}/t/{ids[name]}/v1", tmp / name, steps=steps)
        for name, reward in zip(ids, (1.0, 1.0, 0.0, 0.5), strict=True):
            httpx.post(f"{gw}/trajectories/{ids[name]}/finish", json={"reward": reward},
                       timeout=30).raise_for_status()
        yield {"url": gw, "ids": ids}


def _page(browser: Any, errors: list[str]) -> Any:  # noqa: F811
    page = browser.new_page(viewport={"width": WIDTH, "height": 900})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page


def _layout(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"viewer-{name}.png"), full_page=True)
    bad = page.evaluate(LAYOUT_JS)
    assert bad == [], f"{name}: {bad}"


def test_a_recorded_batch_reads_page_by_page(browser: Any, recorded: dict[str, Any]  # noqa: F811
                                             ) -> None:
    from playwright.sync_api import expect

    gw, ids = recorded["url"], recorded["ids"]
    errors: list[str] = []
    page = _page(browser, errors)

    # the status page's search box leads to the group's trajectories
    page.goto(f"{gw}/")
    page.fill("#quick-q", GROUP)
    page.click("#quick-search button")
    expect(page.locator("#search-table tbody tr")).to_have_count(4, timeout=10_000)
    _layout(page, "search")
    page.locator("#search-table a", has_text=ids["claude"]).click()

    # Claude Code: its agent turns, decoded tokens, a hover, its messages
    expect(page.locator("#branch-tree .branch").first).to_be_visible(timeout=10_000)
    calls = httpx.get(f"{gw}/trajectories/{ids['claude']}", timeout=30).json()["calls"]
    expect(page.locator("#calls-table tbody tr")).to_have_count(len(calls))
    tokens = page.locator("#tokens .t")
    expect(tokens.first).to_be_visible()
    assert "<|im_start|>" in page.locator("#tokens .seg").first.inner_text()
    # the 13k-token prompt comes first; the first reply is drawn once scrolled to
    page.locator("#tokens .seg-head.completion").first.scroll_into_view_if_needed()
    trained = page.locator("#tokens .t.tr").first
    trained.hover()
    expect(page.locator("#tip")).to_contain_text("1 (trained here)")
    expect(page.locator("#tip")).to_contain_text("logprob")
    page.locator("#messages details").first.click()
    expect(page.locator("#messages details pre").first).to_be_visible()
    assert "Claude" in page.locator("#messages details").first.inner_text()
    _layout(page, "trajectory-claude")

    # opencode: its title call is a side call with a system prompt of its own
    page.goto(f"{gw}/view/trajectories/{ids['opencode']}")
    expect(page.locator("#branch-tree .branch").first).to_be_visible(timeout=10_000)
    kinds = page.locator("#branch-tree .branch .what").all_text_contents()
    assert any("side call" in k for k in kinds) and any("main" in k for k in kinds), kinds
    page.locator("#branch-tree .branch", has_text="side call").first.click()
    expect(page.locator("#tokens-title")).not_to_contain_text("(main)")
    expect(page.locator("#tokens .t").first).to_be_visible()
    assert "title" in (page.locator("#tokens").text_content() or "").lower()
    _layout(page, "trajectory-opencode-title")
    # its agent re-rendered the tool call it made: the next call ran it from the record
    page.locator("#branch-tree .branch", has_text="main").first.click()
    expect(page.locator("#tokens-title")).to_contain_text("(main)")
    page.locator("#draw-all").check()
    expect(page.locator("#tokens .t.ti").first).to_be_attached(timeout=10_000)
    assert page.locator("#tokens .t").count() == int(
        page.locator("#tokens-summary").inner_text().split(" tokens")[0].replace(",", ""))

    # mini-swe-agent: the replies it dropped are branches, its conversation the main one
    page.goto(f"{gw}/view/trajectories/{ids['mini-b']}")
    expect(page.locator("#branch-tree .branch").first).to_be_visible(timeout=10_000)
    kinds = page.locator("#branch-tree .branch .what").all_text_contents()
    assert any("dropped turn" in k for k in kinds), kinds
    _layout(page, "trajectory-mini-swe-agent")
    page.locator("#show-ids").check()
    expect(page.locator("#tokens.ids")).to_have_count(1)
    first = page.locator("#tokens .t").first.inner_text()
    assert first.isdigit(), first  # the id, not its text

    # the group side by side: each member's reward and the advantage GRPO gives it
    page.click("#traj-facts a")
    expect(page.locator("#group-table tbody tr")).to_have_count(4, timeout=10_000)
    view = httpx.get(f"{gw}/groups/{GROUP}/view", timeout=30).json()
    shown = page.locator("#group-table tbody tr td:nth-child(5)").all_text_contents()
    advantages = [m["advantage"] for m in view["members"]]
    assert shown == [("+" if a > 0 else "") + f"{a:.3f}" for a in advantages], shown
    _layout(page, "group")
    page.close()
    assert not errors, errors


def test_each_credential_sees_only_what_it_may(browser: Any, loop_thread: LoopThread,  # noqa: F811
                                               tmp_path_factory: pytest.TempPathFactory
                                               ) -> None:
    from playwright.sync_api import expect

    admin, trainer, harness = "v-admin", "v-trainer", "v-harness"
    cfg = SimServerConfig(model=MODEL, speed=50, seed=2, output_len_median=12)
    with logged_gateway(loop_thread, tmp_path_factory, cfg, admin_token=admin,
                        trainer_token=trainer, api_keys=[harness]) as (gw, _):
        traj = "roles-" + uuid.uuid4().hex[:6]
        httpx.post(f"{gw}/t/{traj}/v1/chat/completions", timeout=30,
                   headers={"Authorization": f"Bearer {harness}"},
                   json={"model": MODEL, "max_tokens": 12, "messages": [
                       {"role": "user", "content": "a secret task"}]}).raise_for_status()
        errors: list[str] = []
        page = browser.new_page(viewport={"width": WIDTH, "height": 900})
        page.on("pageerror", lambda e: errors.append(str(e)))  # the refusals log 401/403
        seen = {}
        for who, key in (("harness", harness), ("trainer", trainer), ("admin", admin)):
            page.goto(f"{gw}/view/search")
            page.fill("#view-token", key)
            page.click("#token-form button[type=submit]")
            page.goto(f"{gw}/view/trajectories/{traj}")
            expect(page.locator("#view-note")).not_to_have_text("Loading…", timeout=10_000)
            if who != "harness":
                expect(page.locator("#tokens .t").first).to_be_attached(timeout=10_000)
            seen[who] = {"note": page.locator("#view-note").inner_text(),
                         "data": page.locator("#traj-view").is_visible(),
                         "text": (page.locator("#tokens").text_content() or "")
                         if page.locator("#traj-view").is_visible() else ""}
            if who == "admin":
                page.locator("#messages details").first.click()
                expect(page.locator("#messages pre").first).to_contain_text("a secret task")
        page.close()
    assert not seen["harness"]["data"] and "cannot read trajectories" in seen["harness"]["note"]
    assert seen["trainer"]["data"] and "secret" not in seen["trainer"]["text"]
    assert "<|im_start|>" not in seen["trainer"]["text"]  # ids, not text
    assert "secret" in seen["admin"]["text"]
    assert not errors, errors


def test_the_committed_screenshots_exist() -> None:
    """docs/status-page.md shows these; a rename of the pages must bring them along."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
    for name in ("search", "trajectory-claude", "trajectory-opencode-title",
                 "trajectory-mini-swe-agent", "group"):
        assert (docs / f"viewer-{name}.png").is_file(), name


def test_weight_versions_and_routed_experts_on_the_page(
        browser: Any, loop_thread: LoopThread,  # noqa: F811
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A trajectory whose calls ran on two weight versions, on an engine that returns
    routed experts: the version marker sits where the version changes, and a hover over a
    token shows its experts per layer."""
    from playwright.sync_api import expect

    from backends.sim.routes import MOE_SHAPES

    cfg = SimServerConfig(model=MODEL, speed=50, seed=4, output_len_median=12,
                          enable_return_routed_experts=True, moe=MOE_SHAPES["tiny-moe"])
    with logged_gateway(loop_thread, tmp_path_factory, cfg) as (gw, _), \
            httpx.Client(base_url=gw, timeout=30) as http:
        traj = "versions-" + uuid.uuid4().hex[:6]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "count the files"}]
        for turn in range(3):
            if turn == 2:
                http.put("/admin/weight-version", json={"version": "5"}).raise_for_status()
            r = http.post(f"/t/{traj}/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": 10, "ignore_eos": True})
            r.raise_for_status()
            messages += [{"role": "assistant",
                          "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"there are {turn} more"}]
        errors: list[str] = []
        page = _page(browser, errors)
        page.goto(f"{gw}/view/trajectories/{traj}")
        marker = page.locator("#tokens .vb")
        expect(marker).to_have_count(1, timeout=10_000)
        expect(marker).to_have_text("v5")
        following = marker.evaluate("m => m.nextElementSibling.dataset.i")
        view = http.get(f"/trajectories/{traj}/view").json()["tokens"]
        assert [int(following), "5"] == view["versions"][-1][::2]  # the run's start
        page.locator("#tokens .t.tr").first.hover()
        expect(page.locator("#tip .routes")).to_contain_text("L0:", timeout=10_000)
        layers = page.locator("#tip .routes").inner_text().count("\nL")
        assert layers == MOE_SHAPES["tiny-moe"].num_layers
        page.close()
    assert not errors, errors
