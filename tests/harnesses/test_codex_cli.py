"""OpenAI's Codex CLI as shipped (``codex exec``, Responses API) against the gateway over
a scripted simulated server: it calls its shell tool, runs the command, and finishes
with a text answer, every call answered 200 and recorded with its tokens.

Codex is given nothing but a model provider (base URL with the trajectory id, the
Responses wire API, an env var holding the key) and the model name: no feature flags.
What it sends and what each part becomes is in docs/integrations.md ("Codex CLI").

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

#: Codex 0.169's shell tool (unified exec): the simulated model calls it on turn 0 with
#: a harmless read of a file the test wrote, then answers in text.
SHELL_CALL = ToolCall("exec_command", json.dumps({"cmd": "cat proof.txt"}))
KEY_ENV = "GATEWAY_API_KEY"


@pytest.fixture(scope="module")
def codex() -> Path:
    """The Codex CLI installed by ``make harnesses``."""
    return npm_cli("codex", "Codex CLI")


@pytest.fixture(scope="module")
def codex_gateway(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[str, StatusLog]]:
    """A gateway (SQLite) over one simulated server that calls Codex's shell tool on the
    first turn and answers in text after; and the log of the gateway's answers."""
    from backends.sim.state import SimServerConfig

    cfg = SimServerConfig(model=MODEL, speed=50, seed=11, output_len_median=20,
                          tool_script=(SHELL_CALL,))
    with logged_gateway(loop_thread, tmp_path_factory, cfg) as served:
        yield served


def codex_config(base_url: str) -> str:
    """The whole ``~/.codex/config.toml``: one model provider and the model, no more."""
    return (f'model = "{MODEL}"\nmodel_provider = "gateway"\n\n'
            f'[model_providers.gateway]\nname = "rollout-gateway"\n'
            f'base_url = "{base_url}"\nwire_api = "responses"\nenv_key = "{KEY_ENV}"\n')


def run_codex(exe: Path, base_url: str, task: str, home: Path, work: Path
              ) -> tuple[subprocess.CompletedProcess[str], str]:
    """``codex exec`` with a fresh HOME holding only :func:`codex_config`; its JSONL
    events (``--json``) and final message (``-o``) come back.

    ``--skip-git-repo-check``: the scratch work dir is not a git repository. No sandbox
    or approval flag: ``exec`` never asks for approval, and its default read-only sandbox
    lets the scripted command (a read) run. Telemetry and update checks cannot reach the
    network here; the timeout bounds the run whatever they do."""
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(codex_config(base_url))
    last = home / "last-message.txt"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CODEX_", "OPENAI_"))}
    env.update(HOME=str(home), **{KEY_ENV: "EMPTY"})
    proc = subprocess.run(
        [str(exe), "exec", "--skip-git-repo-check", "--json", "-o", str(last), task],
        cwd=work, env=env, capture_output=True, text=True, timeout=180,
        stdin=subprocess.DEVNULL)
    return proc, last.read_text() if last.exists() else ""


def test_codex_exec_runs_its_shell_tool_through_the_gateway(codex, codex_gateway, tmp_path):
    gw, log = codex_gateway
    traj = "codex-" + uuid.uuid4().hex[:8]
    secret = "proof-" + uuid.uuid4().hex
    work = tmp_path / "work"
    work.mkdir()
    (work / "proof.txt").write_text(secret + "\n")
    base_url = f"{gw}/t/{traj}/v1"

    proc, last = run_codex(codex, base_url, "Show me what proof.txt says.", tmp_path / "home",
                           work)
    said = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ran = [e["item"] for e in events if e.get("type") == "item.completed"
           and e["item"].get("type") == "command_execution"]
    assert len(ran) == 1 and "cat proof.txt" in ran[0]["command"], said
    assert ran[0]["exit_code"] == 0 and secret in ran[0]["aggregated_output"], said
    assert any(e.get("type") == "turn.completed" for e in events), said
    assert not [e for e in events if e.get("type") in ("turn.failed", "error")], said

    mine = [a for a in log.answers if a[1].startswith(f"/t/{traj}/")]
    assert mine and all(a == ("POST", f"/t/{traj}/v1/responses", 200) for a in mine), mine
    calls = recorded_calls(gw, traj, endpoint="responses", at_least=2)
    assert len(calls) == len(mine) == 2
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop"]
    tok = get_tokenizer()
    # the command's output went back to the model in the next call's prompt...
    assert secret in tok.decode(calls[1]["prompt_delta_ids"])
    # ...and Codex's final message is the text the model generated last
    assert last.strip() == output_text(tok, calls[1]["completion_ids"]).strip() != ""
    # every generated token is in an exported sample (whichever branch), under loss mask 1
    print(assert_every_token_kept(gw, traj).line("codex exec"))


def test_codex_on_a_plain_v1_base_url_is_one_trajectory(codex, codex_gateway, tmp_path):
    """No trajectory in the base URL: Codex's own ``session-id`` header (its thread id)
    tags every call, so one run is one trajectory (it was one ``auto-`` per call)."""
    gw, log = codex_gateway
    work = tmp_path / "work"
    work.mkdir()
    (work / "proof.txt").write_text("plain\n")
    before = {t["id"] for t in httpx.get(f"{gw}/trajectories", timeout=10).json()["data"]}

    proc, _ = run_codex(codex, f"{gw}/v1", "Show me what proof.txt says.",
                        tmp_path / "home", work)
    said = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (thread,) = [e["thread_id"] for e in events if e.get("type") == "thread.started"]
    calls = recorded_calls(gw, thread, endpoint="responses", at_least=2)
    after = {t["id"] for t in httpx.get(f"{gw}/trajectories", timeout=10).json()["data"]}
    assert after - before == {thread}, (after - before, said)
    assert [c["seq"] for c in calls] == list(range(len(calls)))
    assert [a for a in log.answers if a[1] == "/v1/responses"] == \
        [("POST", "/v1/responses", 200)] * len(calls)
