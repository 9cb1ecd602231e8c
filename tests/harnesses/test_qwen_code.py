"""Qwen Code as shipped (``qwen "<task>"``, its OpenAI provider, chat completions) against
the gateway over a seeded, scripted simulated server.

Qwen Code is given nothing but ``OPENAI_BASE_URL`` (with the trajectory id),
``OPENAI_API_KEY`` and ``OPENAI_MODEL``, in a fresh HOME: it streams every turn, its first
request ~60 KB (system prompt, skills, ten tools: ~15.6k prompt tokens), and asks for
``max_tokens`` 32768 (clamped by the gateway to the context the prompt leaves).

Two runs, each on a fresh server (its draws are seeded, so calls, branches and generated
tokens are the same on every run):

- the task done with a tool: the simulated model calls ``read_file`` on the proof file,
  then answers in text. Two calls on one branch; the main sample is that conversation,
  trained whole. Qwen Code starts its memory-extraction subagent only after a turn that
  ended on the user's message, not on a tool result, so there is no side call here.
- the task answered in one text call: Qwen Code then runs its memory-extraction subagent
  (its own system prompt: a conversation of its own) for one call. Both conversations are
  one call long and the subagent's generates more (on this seed, 32 tokens against 17);
  main must still be the answer (the longest sequence, tools and task in its prompt).

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


@pytest.fixture(scope="module")
def qwen() -> Path:
    """Qwen Code installed by ``make harnesses``."""
    return npm_cli("qwen", "Qwen Code")


def run_qwen(exe: Path, base_url: str, home: Path, work: Path
             ) -> tuple[list[dict[str, Any]], str, float]:
    """``qwen "<task>"`` (one-shot) with a fresh HOME and only its base URL, key and model
    from the environment (none of the caller's OPENAI_*, QWEN_* or DASHSCOPE_* settings
    leak in); its events (``stream-json``), what it said, and the run's wall time. It
    must end in success.

    No approval flag: ``read_file`` needs no approval. Telemetry and update checks cannot
    reach the network here; the timeout bounds the run whatever they do."""
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "QWEN_", "DASHSCOPE_"))}
    env.update(HOME=str(home), OPENAI_BASE_URL=base_url, OPENAI_API_KEY="sk-none",
               OPENAI_MODEL=MODEL)
    # the first prompt (~15.6k tokens) and its clamped max_tokens fit Qwen3's own context
    events, said, wall = run_cli([str(exe), TASK, "--output-format", "stream-json"], work,
                                 env)
    final = [e for e in events if e.get("type") == "result"]
    assert len(final) == 1 and final[0]["subtype"] == "success", said
    assert not final[0]["is_error"], said
    return events, said, wall


def test_qwen_code_reads_a_file_and_main_is_its_conversation(
        qwen: Path, loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    work, secret = proof_workspace(tmp_path)
    read = ToolCall("read_file", json.dumps({"file_path": str(work / "proof.txt")}))
    traj = "qwen-" + uuid.uuid4().hex[:8]
    sim = scripted_sim(17, (read,))
    with logged_gateway(loop_thread, tmp_path_factory, sim) as (gw, log):
        events, said, wall = run_qwen(qwen, f"{gw}/t/{traj}/v1", tmp_path / "home", work)
        blocks = [b for e in events if e.get("type") in ("assistant", "user")
                  for b in e["message"]["content"] if isinstance(b, dict)]
        uses = [b for b in blocks if b.get("type") == "tool_use"]
        results = [b for b in blocks if b.get("type") == "tool_result"]
        assert [b["name"] for b in uses] == ["read_file"], said
        assert len(results) == 1 and not results[0]["is_error"], said
        assert secret in json.dumps(results[0]["content"]), said  # the file was read
        (final,) = [e for e in events if e.get("type") == "result"]

        mine = [a for a in log.answers if a[1].startswith(f"/t/{traj}/")]
        assert mine and all(a == ("POST", f"/t/{traj}/v1/chat/completions", 200)
                            for a in mine), mine
        calls = recorded_calls(gw, traj, endpoint="chat", at_least=len(mine))
        assert len(calls) == len(mine) == 2
        assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop"]
        tok = get_tokenizer()
        # the file's content went back to the model in the next call's prompt...
        assert secret in tok.decode(calls[1]["prompt_delta_ids"])
        # ...and Qwen Code's answer is the text the model generated last
        assert final["result"].strip() == output_text(tok, calls[1]["completion_ids"]).strip()

        # main is the conversation Qwen Code ended on, trained whole; nothing else
        assert_main_is(gw, traj, {0, 1})
        kept = assert_every_token_kept(gw, traj)
        report = harness_report(gw, traj)
    print(f"\nqwen (Qwen Code) {wall:.1f} s")
    print(kept.line("qwen (sim)"))
    print(report.line("qwen (sim)"))
    assert report.calls == kept.calls == 2 and report.branches == kept.branches == 1
    assert report.main_trained == report.generated == kept.kept > 0
    assert report.tree_trained == report.generated and report.mismatches == 0


def test_qwen_code_memory_subagent_is_not_main(
        qwen: Path, loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    work, _ = proof_workspace(tmp_path)
    traj = "qwen-" + uuid.uuid4().hex[:8]
    # seed 0: the answer draws 17 tokens, the memory subagent's call 32
    with logged_gateway(loop_thread, tmp_path_factory, scripted_sim(0, (False,))) as (gw, log):
        events, _, _ = run_qwen(qwen, f"{gw}/t/{traj}/v1", tmp_path / "home", work)
        (final,) = [e for e in events if e.get("type") == "result"]
        mine = [a for a in log.answers if a[1].startswith(f"/t/{traj}/")]
        calls = recorded_calls(gw, traj, endpoint="chat", at_least=2)
        assert len(calls) == len(mine) == 2, mine
        tok = get_tokenizer()
        task, memory = calls
        # the answer came first; the subagent's call, under its own system prompt, after
        assert final["result"].strip() == output_text(tok, task["completion_ids"]).strip()
        assert "memory extraction subagent" in tok.decode(memory["prompt_delta_ids"])
        kept = assert_every_token_kept(gw, traj)
        assert kept.branches == 2 and kept.kept == kept.generated
        print(harness_report(gw, traj).line("qwen, answered in text (sim)"))
        assert_main_is(gw, traj, {task["seq"]})
