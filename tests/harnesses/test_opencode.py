"""opencode as shipped (``opencode run``, an ``@ai-sdk/openai-compatible`` provider, chat
completions) against the gateway over a seeded, scripted simulated server.

opencode is given nothing but an ``opencode.json`` in its work dir naming one provider
(its base URL with the trajectory id, a key, the one model) and that model, in a fresh
HOME. Beside the agent it asks the same model for the session's title (its own system
prompt, no tools): a conversation of its own. It also sends its session id
(``X-Session-Id``), which the trajectory in the path outranks. At start it asks
models.dev for its model list and npm for its plugin's metadata; with no network both
fail, and it runs on.

Two runs, each on a fresh server (its draws are seeded, so calls, branches and generated
tokens are the same on every run):

- the task done with a tool: the simulated model calls ``read`` on the proof file, then
  answers in text. The agent's two calls are one branch, the title call another; the
  main sample is the agent's conversation, trained whole, and the title is trained in its
  own sample.
- the task answered in one text call: agent and title are both one call long and the
  title generates more (on this seed, 57 tokens against 39); main must still be the
  answer (the longest sequence: the agent's tools and task are in its prompt).

The binary comes from ``make harnesses`` (scripts/setup-harnesses.sh); ``make pytest``
points ``ROLLOUT_GATEWAY_NPM_BIN`` at its folder. Without it these tests FAIL, never skip.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from backends.sim.chat import ToolCall, output_text
from backends.sim.tokenizer import get_tokenizer
from tests.harnesses.conftest import (
    MODEL,
    logged_gateway,
    npm_cli,
    proof_workspace,
    run_cli,
    scripted_sim,
)
from tests.harnesses.trace import (
    assert_every_token_kept,
    assert_main_is,
    harness_report,
    recorded_calls,
)
from tests.servers import LoopThread

TASK = "Show me what proof.txt says."
TITLE_PROMPT = "You are a title generator"


@pytest.fixture(scope="module")
def opencode() -> Path:
    """opencode installed by ``make harnesses``."""
    return npm_cli("opencode", "opencode")


def opencode_config(base_url: str) -> dict[str, Any]:
    """The whole ``opencode.json``: one OpenAI-compatible provider and its model."""
    return {"provider": {"gateway": {
                "npm": "@ai-sdk/openai-compatible", "name": "rollout-gateway",
                "options": {"baseURL": base_url, "apiKey": "sk-none"},
                "models": {MODEL: {}}}},
            "model": f"gateway/{MODEL}"}


def run_opencode(exe: Path, base_url: str, home: Path, work: Path
                 ) -> tuple[list[dict[str, Any]], str, float]:
    """``opencode run`` in ``work`` (holding :func:`opencode_config`) with a fresh HOME and
    nothing from the caller's OPENCODE_* environment; its events (``--format json``), what
    it said, and the run's wall time.

    ``PWD`` is the work dir, as a shell that ``cd``-ed there would leave it: opencode takes
    its project directory from ``PWD`` rather than from its working directory (with this
    process's ``PWD`` it read the config of the repository the tests run in, and fell back
    to its own hosted model). No permission flag: ``read`` needs no approval. The timeout
    bounds the run whatever its network calls do."""
    home.mkdir(parents=True)
    (work / "opencode.json").write_text(json.dumps(opencode_config(base_url)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCODE_")}
    env.update(HOME=str(home), PWD=str(work))
    events, said, wall = run_cli([str(exe), "run", "--format", "json", TASK], work, env)
    assert not [e for e in events if e.get("type") == "error"], said
    return events, said, wall


def _answer(events: list[dict[str, Any]]) -> str:
    """The text opencode ended on: its last text part."""
    texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
    assert texts, events
    return str(texts[-1])


def _split(calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The agent's calls and the title call (the one under the title generator's prompt)."""
    tok = get_tokenizer()
    titles = [c for c in calls if TITLE_PROMPT in tok.decode(c["prompt_delta_ids"])]
    assert len(titles) == 1, [c["seq"] for c in titles]
    return [c for c in calls if c is not titles[0]], titles[0]


def test_opencode_reads_a_file_and_main_is_the_agents_conversation(
        opencode: Path, loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    work, secret = proof_workspace(tmp_path)
    read = ToolCall("read", json.dumps({"filePath": str(work / "proof.txt")}))
    traj = "opencode-" + uuid.uuid4().hex[:8]
    sim = scripted_sim(17, (read,))
    with logged_gateway(loop_thread, tmp_path_factory, sim) as (gw, log):
        events, said, wall = run_opencode(opencode, f"{gw}/t/{traj}/v1", tmp_path / "home",
                                          work)
        tools = [e["part"] for e in events if e.get("type") == "tool_use"]
        assert [t["tool"] for t in tools] == ["read"], said
        assert tools[0]["state"]["status"] == "completed", said
        assert secret in tools[0]["state"]["output"], said  # the file was read

        mine = [a for a in log.answers if a[1].startswith(f"/t/{traj}/")]
        assert mine and all(a == ("POST", f"/t/{traj}/v1/chat/completions", 200)
                            for a in mine), mine
        calls = recorded_calls(gw, traj, endpoint="chat", at_least=len(mine))
        assert len(calls) == len(mine) == 3
        agent, title = _split(calls)
        assert [c["finish_reason"] for c in agent] == ["tool_calls", "stop"]
        assert agent[0]["branch"] == agent[1]["branch"] != title["branch"]
        tok = get_tokenizer()
        # the file's content went back to the model in the agent's next prompt...
        assert secret in tok.decode(agent[1]["prompt_delta_ids"])
        # ...and opencode ended on the text the agent's model generated last
        assert _answer(events).strip() == output_text(tok, agent[1]["completion_ids"]).strip()

        # main is the agent's conversation, trained whole; the title trains on its own
        assert_main_is(gw, traj, {c["seq"] for c in agent})
        kept = assert_every_token_kept(gw, traj)
        report = harness_report(gw, traj)
    print(f"\nopencode {wall:.1f} s")
    print(kept.line("opencode run (sim)"))
    print(report.line("opencode run (sim)"))
    assert report.calls == kept.calls == 3 and report.branches == kept.branches == 2
    assert report.main_trained == sum(len(c["completion_ids"]) for c in agent)
    assert report.generated == report.main_trained + len(title["completion_ids"])
    assert kept.kept == report.generated and report.mismatches == 0
    assert report.tree_trained == report.generated


def test_opencode_title_call_is_not_main(
        opencode: Path, loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    work, _ = proof_workspace(tmp_path)
    traj = "opencode-" + uuid.uuid4().hex[:8]
    # seed 4: the title draws 57 tokens, the answer 39
    with logged_gateway(loop_thread, tmp_path_factory, scripted_sim(4, (False,))) as (gw, log):
        events, _, _ = run_opencode(opencode, f"{gw}/t/{traj}/v1", tmp_path / "home", work)
        mine = [a for a in log.answers if a[1].startswith(f"/t/{traj}/")]
        calls = recorded_calls(gw, traj, endpoint="chat", at_least=2)
        assert len(calls) == len(mine) == 2, mine
        (answer,), _title = _split(calls)
        tok = get_tokenizer()
        assert _answer(events).strip() == output_text(tok, answer["completion_ids"]).strip()
        kept = assert_every_token_kept(gw, traj)
        assert kept.branches == 2 and kept.kept == kept.generated
        print(harness_report(gw, traj).line("opencode run, answered in text (sim)"))
        assert_main_is(gw, traj, {answer["seq"]})
