"""``rollout-gateway bench viewer``: a long trajectory in the trajectory viewer, in Chromium.

One simulated engine (``sim-backend``, 131k context) and the gateway (``python -m gateway
serve``, SQLite) each in its own process; one trajectory of ``calls`` turns, each adding a
tool observation of ``prompt_tokens`` and generating ``completion_tokens`` (200 x (250 +
250) = 100k tokens by default), run through the gateway as a harness does (its replies
echoed back). Then:

- **the API**: ``GET /trajectories/{id}/view`` cold (the engine decodes each distinct id)
  and warm (from the cache), its size;
- **the page**, in headless Chromium at 1280 x 900, in two modes alternated ``repeats``
  times: ``blocks`` (the default: tokens drawn block by block as they scroll into view)
  and ``all`` (the "draw every token" switch: every token drawn at once, what a page
  without blocks does). Per run: time from navigation to the first token on screen, the
  main thread's long tasks (over 50 ms: the browser cannot answer input meanwhile) until
  then and while the token pane is scrolled from top to bottom a screen at a time, the
  time that scroll takes, the DOM's elements and the JS heap at both points.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.harness import procs
from bench.harness.hosting import free_port
from bench.runners.overhead import machine
from bench.runners.store import words_text

Progress = Callable[[str], None]
MODEL = "qwen3-14b"
MODES = ("blocks", "all")
WIDTH, HEIGHT = 1280, 900
#: collects the main thread's long tasks from the page's first script on
LONG_TASKS = """
window.__longTasks = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__longTasks.push([e.startTime, e.duration]);
}).observe({ type: "longtask", buffered: true });
"""
#: scrolls the token pane a screen at a time to its end, a frame per step; its wall time
SCROLL = """async () => {
  const host = document.getElementById("tokens");
  const frame = () => new Promise((r) => requestAnimationFrame(() => r()));
  const t0 = performance.now();
  let steps = 0;
  while (host.scrollTop + host.clientHeight < host.scrollHeight - 2 && steps < 100000) {
    host.scrollTop += host.clientHeight;
    await frame(); await frame();
    steps += 1;
  }
  return [performance.now() - t0, steps];
}"""
STATE = """() => [document.getElementsByTagName("*").length,
  (performance.memory || {}).usedJSHeapSize || null, document.querySelectorAll("#tokens .t").length,
  performance.now()]"""


@dataclass
class ViewerOptions:
    calls: int = 200
    prompt_tokens: int = 250
    completion_tokens: int = 250
    repeats: int = 3
    speed: float = 1000.0
    chromium: str = "/usr/bin/chromium"
    seed: int = 1
    out: Path = Path("artifacts/bench/viewer")


def record(gw: str, opts: ViewerOptions, say: Progress) -> str:
    """The long trajectory, through the gateway as a harness runs it; its id."""
    tid = f"viewer-bench-{opts.seed}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words_text(400, opts.seed)},
        {"role": "user", "content": words_text(100, opts.seed + 1)}]
    with httpx.Client(base_url=gw, timeout=300) as http:
        for turn in range(opts.calls):
            r = http.post(f"/t/{tid}/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": opts.completion_tokens,
                "ignore_eos": True})
            r.raise_for_status()
            messages += [{"role": "assistant",
                          "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": words_text(
                             opts.prompt_tokens, opts.seed * 1000 + turn)}]
            if turn % 20 == 19:
                say(f"recorded {turn + 1}/{opts.calls} calls")
        http.post(f"/trajectories/{tid}/finish", json={"reward": 1.0}).raise_for_status()
    return tid


def api(gw: str, tid: str) -> dict[str, Any]:
    """The view endpoint cold (pieces decoded by the engine) and warm."""
    out: dict[str, Any] = {}
    with httpx.Client(base_url=gw, timeout=600) as http:
        for name in ("cold", "warm", "warm"):
            started = time.perf_counter()
            r = http.get(f"/trajectories/{tid}/view")
            r.raise_for_status()
            out.setdefault(f"{name}_s", []).append(time.perf_counter() - started)
        view = r.json()
    out["bytes"] = len(r.content)
    out["tokens"] = len(view["tokens"]["token_ids"])
    out["distinct_ids"] = len(view["tokens"]["pieces"] or {})
    out["calls"] = len(view["calls"])
    out["pieces_note"] = view["tokens"]["pieces_note"]
    return out


def page_run(browser: Any, gw: str, tid: str, mode: str) -> dict[str, Any]:
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    page.add_init_script(LONG_TASKS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    query = "?render=all" if mode == "all" else ""
    started = time.perf_counter()
    page.goto(f"{gw}/view/trajectories/{tid}{query}")
    page.wait_for_selector("#tokens .t", timeout=600_000)
    first_s = time.perf_counter() - started
    page.evaluate("() => new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)))")
    nodes0, heap0, drawn0, t_first = page.evaluate(STATE)
    scroll_ms, steps = page.evaluate(SCROLL)
    nodes1, heap1, drawn1, _ = page.evaluate(STATE)
    tasks = page.evaluate("() => window.__longTasks")
    page.close()
    if errors:
        raise RuntimeError(f"the page failed: {errors}")
    before = [d for s, d in tasks if s <= t_first]
    during = [d for s, d in tasks if s > t_first]
    return {"mode": mode, "first_token_s": first_s,
            "longest_task_ms_to_first": max(before, default=0.0),
            "long_tasks_to_first": len(before), "long_task_ms_to_first": sum(before),
            "scroll_s": scroll_ms / 1000, "scroll_steps": steps,
            "longest_task_ms_scrolling": max(during, default=0.0),
            "long_tasks_scrolling": len(during),
            "elements_at_first": nodes0, "elements_at_end": nodes1,
            "tokens_drawn_at_first": drawn0, "tokens_drawn_at_end": drawn1,
            "heap_mb_at_first": heap0 / 2**20 if heap0 else None,
            "heap_mb_at_end": heap1 / 2**20 if heap1 else None}


def run_viewer(opts: ViewerOptions, say: Progress, command: str) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    opts.out.mkdir(parents=True, exist_ok=True)
    logs = opts.out / "logs"
    logs.mkdir(exist_ok=True)
    doc: dict[str, Any] = {"command": command, "machine": machine(),
                           "shape": {"calls": opts.calls, "prompt_tokens": opts.prompt_tokens,
                                     "completion_tokens": opts.completion_tokens,
                                     "viewport": f"{WIDTH}x{HEIGHT}"}}
    port = free_port()
    engine = f"http://127.0.0.1:{port}"
    sim = [procs.PY, "-m", "gateway", "sim-backend", "--port", str(port), "--model", MODEL,
           "--speed", str(opts.speed), "--max-model-len", "131072"]
    with tempfile.TemporaryDirectory() as tmp, \
            procs.process(sim, ready_url=f"{engine}/health", log=logs / "engine.log"), \
            procs.gateway(engine, f"sqlite+aiosqlite:///{tmp}/viewer.db", None,
                          log=logs / "gateway.log") as gw:
        say(f"recording {opts.calls} calls")
        tid = record(gw, opts, say)
        say("the view endpoint, cold and warm")
        doc["api"] = api(gw, tid)
        runs = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=opts.chromium, headless=True,
                                         args=["--no-sandbox", "--disable-gpu",
                                               "--enable-precise-memory-info"])
            for run in range(opts.repeats):
                for mode in MODES:
                    say(f"run {run + 1}/{opts.repeats}: {mode}")
                    runs.append({"run": run, **page_run(browser, gw, tid, mode)})
            browser.close()
    doc["runs"] = runs
    doc["summary"] = {mode: {k: statistics.median(r[k] for r in runs if r["mode"] == mode)
                             for k in runs[0] if k not in ("mode", "run")
                             and all(r[k] is not None for r in runs)}
                      for mode in MODES}
    return doc


def viewer_markdown(doc: dict[str, Any]) -> str:
    m, sh, a = doc["machine"], doc["shape"], doc["api"]
    lines = ["Command:", "", "```", doc["command"], "```", "",
             f"Machine: {m['cpu']}, {m['cores']} cores. One trajectory of {a['calls']} "
             f"calls, {a['tokens']:,} tokens ({sh['prompt_tokens']} new prompt and "
             f"{sh['completion_tokens']} generated tokens a call), {a['distinct_ids']:,} "
             f"distinct ids; viewport {sh['viewport']}.", "",
             f"`GET /trajectories/{{id}}/view`: {a['bytes'] / 2**20:.1f} MB; cold (the "
             f"engine decodes each distinct id) {a['cold_s'][0]:.2f} s, warm "
             f"{min(a['warm_s']):.2f} s.", "",
             "Medians over the runs (the modes alternated):", "",
             "| mode | first token on screen (s) | longest task until then (ms) | long tasks "
             "until then (count, total ms) | scroll to the end (s, screens) | longest task "
             "while scrolling (ms) | elements at first / at the end | tokens drawn at first "
             "/ at the end | JS heap at first / at the end (MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, s in doc["summary"].items():
        heap = (f"{s['heap_mb_at_first']:.0f} / {s['heap_mb_at_end']:.0f}"
                if "heap_mb_at_first" in s else "-")
        lines.append(
            f"| {mode} | {s['first_token_s']:.2f} | {s['longest_task_ms_to_first']:.0f} | "
            f"{s['long_tasks_to_first']:.0f}, {s['long_task_ms_to_first']:.0f} | "
            f"{s['scroll_s']:.1f}, {s['scroll_steps']:.0f} | "
            f"{s['longest_task_ms_scrolling']:.0f} | {s['elements_at_first']:,.0f} / "
            f"{s['elements_at_end']:,.0f} | {s['tokens_drawn_at_first']:,.0f} / "
            f"{s['tokens_drawn_at_end']:,.0f} | {heap} |")
    return "\n".join(lines) + "\n"
