"""Google's Gemini CLI as shipped (``gemini -p``, the Gemini API) against the gateway over a
scripted simulated server: it calls its ``read_file`` tool, reads the file, and finishes
with a text answer, every call answered 200 and recorded with its tokens in one branch.

Gemini CLI is given nothing but its settings file (``gemini-api-key`` auth), a key, the
base URL with the trajectory id and the model: it streams every turn
(``:streamGenerateContent?alt=sse``); its own side calls (the web-search tool's
``gemini-3-flash-preview`` call) ask for Google's model names, which the gateway's
``model_aliases`` map to the served model. What it sends and what each part becomes is in
docs/integrations.md ("Gemini CLI").

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

#: The simulated model calls Gemini CLI's read_file on turn 0 (a file the test wrote in
#: the work dir), then answers in text.
READ_CALL = ToolCall("read_file", json.dumps({"file_path": "proof.txt"}))
ALIASES = {"gemini-*": MODEL}
SETTINGS = {"security": {"auth": {"selectedType": "gemini-api-key"}}}


@pytest.fixture(scope="module")
def gemini() -> Path:
    """Gemini CLI installed by ``make harnesses``."""
    return npm_cli("gemini", "Gemini CLI")


@pytest.fixture(scope="module")
def gemini_gateway(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[str, StatusLog]]:
    """A gateway (SQLite, Gemini's model names aliased to the served model) over one
    simulated server that calls read_file on the first turn and answers in text after;
    and the log of the gateway's answers."""
    from backends.sim.state import SimServerConfig

    # Gemini CLI's first prompt (system prompt, eight tool schemas) is ~38 KB
    cfg = SimServerConfig(model=MODEL, speed=50, seed=17, output_len_median=20,
                          max_model_len=131072, tool_script=(READ_CALL,))
    with logged_gateway(loop_thread, tmp_path_factory, cfg, model_aliases=ALIASES) as served:
        yield served


def run_gemini(exe: Path, base_url: str, task: str, home: Path, work: Path
               ) -> subprocess.CompletedProcess[str]:
    """``gemini -p`` with a fresh HOME holding only its settings file, and nothing from
    the caller's GEMINI_* / GOOGLE_* environment; its events come back as
    ``stream-json`` lines. In ``-p`` mode it offers only tools that need no approval
    (read_file, list_directory, glob, ...), so no approval flag is needed."""
    (home / ".gemini").mkdir(parents=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(SETTINGS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GEMINI_", "GOOGLE_"))}
    env.update(HOME=str(home), GEMINI_CLI_TRUST_WORKSPACE="true", GEMINI_API_KEY="sk-none",
               GOOGLE_GEMINI_BASE_URL=base_url)
    return subprocess.run(
        [str(exe), "-m", MODEL, "-p", task, "--output-format", "stream-json"],
        cwd=work, env=env, capture_output=True, text=True, timeout=180,
        stdin=subprocess.DEVNULL)


def test_gemini_cli_reads_a_file_through_the_gateway(gemini, gemini_gateway, tmp_path):
    gw, log = gemini_gateway
    traj = "gemini-" + uuid.uuid4().hex[:8]
    secret = "proof-" + uuid.uuid4().hex
    work = tmp_path / "work"
    work.mkdir()
    (work / "proof.txt").write_text(secret + "\n")

    proc = run_gemini(gemini, f"{gw}/t/{traj}", "Show me what proof.txt says.",
                      tmp_path / "home", work)
    said = f"rc={proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    uses = [e for e in events if e.get("type") == "tool_use"]
    results = [e for e in events if e.get("type") == "tool_result"]
    assert [e.get("tool_name") for e in uses] == ["read_file"], said
    assert len(results) == 1 and results[0].get("status") == "success", said
    final = [e for e in events if e.get("type") == "result"]
    assert len(final) == 1 and final[0].get("status") == "success", said

    mine = [a for a in log.answers if a[1].startswith(f"/t/{traj}/")]
    stream = f"/t/{traj}/v1beta/models/{MODEL}:streamGenerateContent"
    assert mine and all(a == ("POST", stream, 200) for a in mine), mine
    calls = recorded_calls(gw, traj, endpoint="gemini", at_least=len(mine))
    assert len(calls) == len(mine) == 2
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop"]
    tok = get_tokenizer()
    # the file's content went back to the model in the next call's prompt...
    assert secret in tok.decode(calls[1]["prompt_delta_ids"])
    # ...and Gemini CLI's answer is the text the model generated last
    text = "".join(e.get("content", "") for e in events
                   if e.get("type") == "message" and e.get("role") == "assistant")
    assert output_text(tok, calls[1]["completion_ids"]).strip() in text.strip()
    # one branch: the second call continued the first, every generated token trained
    samples = httpx.get(f"{gw}/trajectories/{traj}/samples", timeout=10).json()["data"]
    assert len(samples) == 1 and samples[0]["mismatches"] == []
    kept = assert_every_token_kept(gw, traj)
    assert kept.branches == 1
    print(kept.line("gemini -p"))
