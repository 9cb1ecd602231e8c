"""Anthropic's Claude Code as shipped (``claude -p``, Messages API) against the gateway over
a scripted simulated server: it calls its Bash tool, runs the command, and finishes with
a text answer, every call answered 2xx and recorded with its tokens.

Claude Code is given nothing but its base URL (with the trajectory id) and a key: it asks
for its own model names (``claude-opus-*`` for the agent, ``claude-haiku-*`` for side
calls), which the gateway's ``model_aliases`` map to the served model, and its
``max_tokens`` (128000) is clamped by the gateway to the context the prompt leaves. What it sends and what each part becomes is in docs/integrations.md
("Claude Code").

The binary comes from ``make harnesses`` (scripts/setup-harnesses.sh); ``make pytest``
points ``ROLLOUT_GATEWAY_NPM_BIN`` at its folder. Without it these tests FAIL, never skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.sim.chat import ToolCall, output_text
from backends.sim.tokenizer import get_tokenizer
from tests.harnesses.conftest import MODEL, logged_gateway, npm_cli
from tests.harnesses.trace import StatusLog, assert_every_token_kept, recorded_calls
from tests.servers import LoopThread

#: The simulated model calls Claude Code's Bash tool on turn 0 with a harmless read of a
#: file the test wrote, then answers in text.
COMMAND = "cat proof.txt"
BASH_CALL = ToolCall("Bash", json.dumps({"command": COMMAND,
                                         "description": "Show the proof file"}))
ALIASES = {"claude-*": MODEL}


@pytest.fixture(scope="module")
def claude() -> Path:
    """Claude Code installed by ``make harnesses``."""
    return npm_cli("claude", "Claude Code")


@pytest.fixture(scope="module")
def claude_gateway(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[str, StatusLog]]:
    """A gateway (SQLite, Claude's model names aliased to the served model) over one
    simulated server that calls Bash on the first turn and answers in text after; and the
    log of the gateway's answers."""
    from backends.sim.state import SimServerConfig

    # Claude Code's first prompt (system prompt, a dozen tool schemas, 48 KB) is ~13k
    # tokens (~12k of Qwen3's): it fits the model's own 40,960 context, as sim-backend
    # serves it by default, with the 32,000 max_tokens it asks for clamped by the gateway
    cfg = SimServerConfig(model=MODEL, speed=50, seed=13, output_len_median=20,
                          tool_script=(BASH_CALL,))
    with logged_gateway(loop_thread, tmp_path_factory, cfg, model_aliases=ALIASES) as served:
        yield served


def run_claude(exe: Path, base_url: str, task: str, home: Path, work: Path
               ) -> subprocess.CompletedProcess[str]:
    """``claude -p`` with a fresh HOME and only its base URL and key from the environment
    (none of the caller's ANTHROPIC_* or CLAUDE_* settings leak in); its events come back
    as ``stream-json`` lines.

    No permission flag: Claude Code runs a read-only command such as ``cat`` without
    asking (one that writes would need ``--allowedTools``, since nobody can answer a
    permission prompt in print mode). Telemetry and update checks cannot reach the
    network here (they fail at once); the timeout bounds the run whatever they do."""
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(HOME=str(home), ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY="sk-none")
    return subprocess.run(
        [str(exe), "-p", task, "--output-format", "stream-json", "--verbose"],
        cwd=work, env=env, capture_output=True, text=True, timeout=180,
        stdin=subprocess.DEVNULL)


def test_claude_code_runs_its_bash_tool_through_the_gateway(claude, claude_gateway, tmp_path):
    gw, log = claude_gateway
    traj = "claude-" + uuid.uuid4().hex[:8]
    secret = "proof-" + uuid.uuid4().hex
    work = tmp_path / "work"
    work.mkdir()
    (work / "proof.txt").write_text(secret + "\n")

    proc = run_claude(claude, f"{gw}/t/{traj}", "Show me what proof.txt says.",
                      tmp_path / "home", work)
    said = f"rc={proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [b for e in events if e.get("type") == "user"
               for b in e["message"]["content"] if b.get("type") == "tool_result"]
    assert len(results) == 1 and not results[0].get("is_error"), said
    assert secret in json.dumps(results[0]["content"]), said  # the command really ran
    final = [e for e in events if e.get("type") == "result"]
    assert len(final) == 1 and final[0]["subtype"] == "success", said
    assert not final[0]["is_error"], said

    # every model call answered 2xx; besides them only Claude Code's fire-and-forget
    # connection warm-up (HEAD {base}/api/hello, whose answer it ignores)
    mine = [a for a in log.answers if a[1].startswith(f"/t/{traj}/")]
    posts = [a for a in mine if a[:2] == ("POST", f"/t/{traj}/v1/messages")]
    assert posts and all(200 <= a[2] < 300 for a in posts), mine
    assert {a[:2] for a in mine if a not in posts} <= {("HEAD", f"/t/{traj}/api/hello")}, mine
    calls = recorded_calls(gw, traj, endpoint="messages", at_least=len(posts))
    assert len(calls) == len(posts)
    agent = [c for c in calls if c["finish_reason"] == "tool_calls"]
    assert len(agent) == 1
    after = [c for c in calls if c["seq"] > agent[0]["seq"]]
    tok = get_tokenizer()
    # the command's output went back to the model in the next call's prompt...
    assert any(secret in tok.decode(c["prompt_delta_ids"]) for c in after)
    # ...and Claude Code's final answer is the text the model generated last
    assert final[0]["result"].strip() == output_text(tok, calls[-1]["completion_ids"]).strip()
    # every generated token is in the trajectory's samples under loss mask 1
    print(assert_every_token_kept(gw, traj).line("claude -p"))


def test_claude_code_on_a_plain_base_url_is_one_trajectory(claude, claude_gateway, tmp_path):
    """No trajectory in the base URL: Claude Code's ``x-claude-code-session-id`` (the
    ``session_id`` of its events) tags every call, side calls included."""
    gw, _ = claude_gateway
    work = tmp_path / "work"
    work.mkdir()
    (work / "proof.txt").write_text("plain\n")
    before = {t["id"] for t in httpx.get(f"{gw}/trajectories", timeout=10).json()["data"]}

    proc = run_claude(claude, gw, "Show me what proof.txt says.", tmp_path / "home", work)
    said = f"rc={proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (session,) = {e["session_id"] for e in events if "session_id" in e}
    calls = recorded_calls(gw, session, endpoint="messages", at_least=2)
    after = {t["id"] for t in httpx.get(f"{gw}/trajectories", timeout=10).json()["data"]}
    assert after - before == {session}, (after - before, said)
    assert [c["seq"] for c in calls] == list(range(len(calls)))
    assert calls[0]["prompt_len"] < 20_000  # ~13k: the model's own context holds it
