"""Harnesses the gateway does not own, driven unmodified against simulated vLLM servers.

``scripted_gateway``: real client SDKs and agent harnesses against the gateway over a
scripted simulated server.
The simulated server's ``tool_script`` makes tool use deterministic (a tool call on the
first turn, text afterwards), and :func:`check_exact_trace` ties every recorded token to
what the client saw: each call's completion ids decode to exactly the text and tool call
the harness received, each prompt is the previous prompt plus completion plus the new
messages (no mismatch), and the training sample is their concatenation.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.sim.chat import output_text, render_tool_call
from backends.sim.tokenizer import get_tokenizer
from gateway.app import create_app
from tests.gateway.conftest import gateway_at, loop_thread, make_settings, sim_pool
from tests.harnesses.trace import StatusLog
from tests.servers import LoopThread, app_in_thread

__all__ = ["gateway_at", "loop_thread", "sim_pool"]
MODEL = "qwen3-14b"


@pytest.fixture(scope="module")
def scripted_gateway(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One simulated server that calls a tool on turn 0 and answers in text after, and a
    gateway (SQLite) in front of it."""
    from backends.sim.runner import start_sim_servers
    from backends.sim.state import SimServerConfig

    cfg = SimServerConfig(model=MODEL, speed=50, seed=7, output_len_median=20,
                          tool_script=(True,))
    cm = start_sim_servers([cfg])
    urls = loop_thread.run(cm.__aenter__())
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('gw') / 'gw.db'}"
    with ExitStack() as stack:
        gw = stack.enter_context(app_in_thread(
            loop_thread, lambda: create_app(make_settings(db, urls))))
        yield gw
    loop_thread.run(cm.__aexit__(None, None, None))


def check_exact_trace(gw: str, traj: str, seen: list[tuple[str, list[tuple[str, str]]]]
                      ) -> dict:
    """Assert the trajectory's recorded tokens are exactly what the client saw.

    ``seen``: per call, the text the client received and its tool calls (name, JSON
    arguments as received)."""
    tok = get_tokenizer()
    calls = httpx.get(f"{gw}/trajectories/{traj}").json()["calls"]
    assert [c["seq"] for c in calls] == list(range(len(seen)))
    for call, (text, tools) in zip(calls, seen, strict=True):
        assert call["status"] == "ok" and call["mismatch_pos"] is None
        expected = text + "".join(render_tool_call(n, a) for n, a in tools)
        assert output_text(tok, call["completion_ids"]) == expected
        assert call["completion_ids"][-1] == tok.eos_id
        assert len(call["completion_logprobs"]) == len(call["completion_ids"])
        assert all(lp <= 0 for lp in call["completion_logprobs"])
    for prev, cur in itertools.pairwise(calls):
        assert cur["prompt_offset"] == prev["prompt_offset"] + len(prev["prompt_delta_ids"]) \
            + len(prev["completion_ids"])
    sample = httpx.get(f"{gw}/trajectories/{traj}/sample").json()
    assert len(sample["token_ids"]) == calls[-1]["prompt_len"] + len(calls[-1]["completion_ids"])
    for span, call in zip(sample["calls"], calls, strict=True):
        got = sample["token_ids"][span["completion_start"]:span["completion_end"]]
        assert got == call["completion_ids"]
        assert sample["logprobs"][span["completion_start"]:span["completion_end"]] == \
            call["completion_logprobs"]
    assert sum(sample["loss_mask"]) == sum(len(c["completion_ids"]) for c in calls)
    assert sample["mismatches"] == []
    return sample


DEFAULT_NPM_BIN = Path.home() / ".cache/rollout-gateway/npm/node_modules/.bin"


def npm_cli(name: str, what: str) -> Path:
    """A coding-agent CLI installed by ``make harnesses``; the test fails (never skips)
    with how to install it when it is missing."""
    exe = Path(os.environ.get("ROLLOUT_GATEWAY_NPM_BIN") or DEFAULT_NPM_BIN) / name
    if not os.access(exe, os.X_OK):
        pytest.fail(f"The {what} tests need {exe}, which does not exist. Install it with "
                    "`make harnesses` (scripts/setup-harnesses.sh, pinned, from npm) or "
                    f"point ROLLOUT_GATEWAY_NPM_BIN at the folder holding `{name}`.",
                    pytrace=False)
    return exe


def proof_workspace(tmp_path: Path) -> tuple[Path, str]:
    """A work dir under ``tmp_path`` holding ``proof.txt`` (one line, a fresh secret), for a
    harness to read; the dir and the secret."""
    work = tmp_path / "work"
    work.mkdir()
    secret = "proof-" + uuid.uuid4().hex
    (work / "proof.txt").write_text(secret + "\n")
    return work, secret


def scripted_sim(seed: int, script: tuple[Any, ...]) -> Any:
    """A simulated server's config for one harness run: short answers, its draws seeded,
    tool use scripted (``SimServerConfig.tool_script``)."""
    from backends.sim.state import SimServerConfig

    return SimServerConfig(model=MODEL, speed=50, seed=seed, output_len_median=20,
                           tool_script=script)


def run_cli(argv: list[str], work: Path, env: dict[str, str], timeout: float = 120
            ) -> tuple[list[dict[str, Any]], str, float]:
    """A harness CLI run to its end in ``work`` with ``env`` (stdin closed); it must exit
    0. Its JSON event lines, what it said (for assertion messages), and its wall time."""
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - start
    said = f"rc={proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return events, said, wall


@contextmanager
def logged_gateway(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory,
                   cfg: Any, **settings: Any) -> Iterator[tuple[str, StatusLog]]:
    """A gateway (SQLite, ``settings``) over one simulated server (``cfg``), and the log
    of every answer the gateway sent."""
    from backends.sim.runner import start_sim_servers

    cm = start_sim_servers([cfg])
    urls = loop_thread.run(cm.__aenter__())
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('gw') / 'gw.db'}"
    holder: list[StatusLog] = []

    def app() -> StatusLog:
        holder.append(StatusLog(create_app(make_settings(db, urls, **settings))))
        return holder[0]

    try:
        with ExitStack() as stack:
            gw = stack.enter_context(app_in_thread(loop_thread, app))
            yield gw, holder[0]
    finally:
        loop_thread.run(cm.__aexit__(None, None, None))
