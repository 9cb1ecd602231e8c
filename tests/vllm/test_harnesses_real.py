"""The harnesses as shipped, through the gateway, on a real vLLM engine (CPU, the tiny
random-weight model, hermes tool parser): Codex CLI (``codex exec``, Responses API),
Claude Code (``claude -p``, Messages API), pydantic-ai and smolagents (chat
completions) and the OpenAI Agents SDK (Responses API).

The model is random, so it does not use tools sensibly: with ``tool_choice`` auto it
answers text (now and then with a stray ``<tool_call>`` the parser cannot read) and the
harness ends; smolagents sends ``tool_choice: "required"``, so vLLM's guided decoding
makes a real tool call (a tool's name, random JSON as arguments), which smolagents runs or
hands back to the model as an error until its steps run out. What is under test is the wire
and the tokens: every model call answered 2xx, the harness finished, and every token the
engine generated is under loss mask 1 in an exported sample, with its logprob.

Each run is bounded: Claude Code by ``--max-turns`` (accepted, though ``--help`` does not
list it), Codex (which has no such option) by the subprocess timeout, pydantic-ai by
``UsageLimits(request_limit=...)``, smolagents by ``max_steps``, the Agents SDK by
``max_turns``. pydantic-ai and smolagents also send ``max_tokens`` 200 (the random model
stops on its own after ~700 tokens on average, but now and then after thousands); the
Agents SDK takes a response cut at ``max_output_tokens`` as an error (``ModelBehaviorError``
on ``response.incomplete``), so it runs uncapped, and so do the CLIs (Claude Code asks for
128000, which the gateway clamps to the context left; Codex sends none: vLLM's default,
the context left).

Prompt sizes in the tiny model's tokens (its BPE is ~1.6 characters a token): Codex's
first request as shipped is ~23k; Claude Code's is ~29k with its default tool set
(measured through the gateway on a 64k engine: 29,220 prompt tokens, one call, every token
kept, 82 s) and ~7k with ``--tools Bash``. Prefill on two CPU cores grows faster than
linearly (5k tokens: 2.5 s; 20k: ~20 s; 50k: over 2 min), so Claude Code gets ``--tools Bash``
(its own system prompt, the one tool its simulated test drives) and Codex runs as shipped,
on an engine with a 32k context (``max_position_embeddings`` raised by the builder, for
this engine only).

Not the gateway's doing, and seen here: vLLM's streaming hermes parser swallows the text
after a stray ``<tool_call>`` (neither content nor a tool call reaches the client; the
tokens are recorded all the same), and with ``tool_choice: "required"`` it constrains the
call's envelope but not its arguments unless a tool is ``strict`` (the random model writes
``"arguments": 12345``), so smolagents' tool rejects the call and the next request drops
the model's turn: a branch of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.base import InstanceSpec
from backends.vllm_local import LocalVLLMLauncher
from gateway.app import create_app
from tests.gateway.conftest import loop_thread, make_settings
from tests.harnesses.trace import Kept, StatusLog, assert_every_token_kept
from tests.servers import LoopThread, app_in_thread
from tests.vllm.conftest import REPO_ROOT, SERVED_NAME

__all__ = ["loop_thread"]

# the first test also builds the model and starts the engine: about a minute, and several
# when other jobs share the two cores
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: The engine's context: Codex's first prompt as shipped (~23k tokens) and its answer fit.
MAX_MODEL_LEN = 32768
DEFAULT_NPM_BIN = Path.home() / ".cache/rollout-gateway/npm/node_modules/.bin"
CLI_TIMEOUT_S = 240
TASK = "What is the weather in Paris?"
KEY_ENV = "GATEWAY_API_KEY"


# -- the engine and the gateway -------------------------------------------------------


class WireLog(StatusLog):
    """:class:`StatusLog` that also keeps the JSON body of every POST (what the harness
    sent, before the gateway touched it)."""

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def tapped() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    with suppress(ValueError):
                        self.bodies.append((scope["path"], json.loads(b"".join(chunks))))
            return message

        await super().__call__(scope, tapped, send)

    def sent(self, traj: str) -> list[str]:
        """One line per POST of ``traj``: the fields that shape what the engine runs."""
        lines = []
        for path, body in self.bodies:
            if not path.startswith(f"/t/{traj}/"):
                continue
            tools = [t.get("name") or (t.get("function") or {}).get("name") or t.get("type")
                     for t in body.get("tools") or ()]
            size = len(json.dumps(body))
            keys = ("model", "stream", "tool_choice", "max_tokens", "max_output_tokens",
                    "max_completion_tokens", "stop", "parallel_tool_calls", "thinking",
                    "reasoning", "temperature")
            picked = {k: body[k] for k in keys if k in body}
            lines.append(f"{path.split('/v1/')[-1]} {size} B: {picked} tools={tools}")
        return lines


@pytest.fixture(scope="module")
def long_model_dir(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with ``max_position_embeddings`` = :data:`MAX_MODEL_LEN`."""
    out = tmp_path_factory.mktemp("models") / "tiny-long"
    subprocess.run(
        [vllm_python, "-m", "backends.tinymodel", str(out),
         "--max-positions", str(MAX_MODEL_LEN)],
        cwd=REPO_ROOT, check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def long_engine(vllm_python: str, long_model_dir: Path, loop_thread: LoopThread,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """ONE real vLLM engine for the module's harnesses: a 32k context, 1 GiB of KV cache
    (the tiny model's KV is 1 KiB a token: a million tokens)."""
    if url := os.environ.get("ROLLOUT_GATEWAY_HARNESS_ENGINE_URL"):
        yield url  # an engine started by hand, for working on these tests
        return
    launcher = LocalVLLMLauncher(
        python=vllm_python, model_path=str(long_model_dir), served_model_name=SERVED_NAME,
        device="cpu",
        extra_args=("--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
                    "--enforce-eager"),
        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, start_timeout_s=400,
        log_dir=tmp_path_factory.mktemp("logs"))
    instance = loop_thread.run(launcher.start(InstanceSpec(id="harnesses", model=SERVED_NAME,
                                                           gpus=(0,))), timeout=460)
    try:
        yield instance.url
    finally:
        loop_thread.run(launcher.close(), timeout=60)


@pytest.fixture(scope="module")
def gateway(long_engine: str, loop_thread: LoopThread,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WireLog]]:
    """A gateway (SQLite) over the engine, Claude Code's model names aliased to it; and
    the log of the gateway's answers."""
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('gw') / 'gw.db'}"
    holder: list[WireLog] = []

    def app() -> WireLog:
        settings = make_settings(db, [long_engine], model_aliases={"claude-*": SERVED_NAME})
        holder.append(WireLog(create_app(settings)))
        return holder[0]

    with ExitStack() as stack:
        gw = stack.enter_context(app_in_thread(loop_thread, app))
        yield gw, holder[0]


def _check(gw: str, log: WireLog, traj: str, *, path: str, name: str, took: float,
           wait_s: float = 10.0) -> tuple[Kept, list[dict[str, Any]]]:
    """Every model call the harness made answered 2xx and recorded ok, and every token
    the engine generated kept under loss mask 1; prints the Kept line and the calls."""
    posts = [a for a in log.answers if a[:2] == ("POST", f"/t/{traj}{path}")]
    others = [a for a in log.answers if a[1].startswith(f"/t/{traj}/") and a[:2] != (
        "POST", f"/t/{traj}{path}")]
    assert posts and all(200 <= a[2] < 300 for a in posts), posts
    deadline = time.monotonic() + wait_s
    while True:  # records are written by a batched writer
        calls = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json().get("calls", [])
        if len(calls) >= len(posts) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(calls) == len(posts), (len(calls), posts)
    assert all(c["status"] == "ok" and c["error"] is None for c in calls), calls
    kept = assert_every_token_kept(gw, traj)
    assert kept.calls == len(calls) and kept.kept == kept.generated > 0
    print(f"\n{kept.line(name)}; {took:.0f} s")
    for c in sorted(calls, key=lambda c: c["seq"]):
        print(f"  seq {c['seq']}: {c['endpoint']} prompt {c['prompt_len']} "
              f"(kept_len {c['kept_len']}), {len(c['completion_ids'])} generated, "
              f"finish {c['finish_reason']}, branch {c['branch']}"
              f" (mismatch at {c['mismatch_pos']})" * (c["mismatch_pos"] is not None))
    for line in log.sent(traj):
        print(f"  sent: {line}")
    if others:
        print(f"  other requests: {others}")
    return kept, calls


# -- the CLIs -------------------------------------------------------------------------


def _npm_bin(name: str) -> Path:
    exe = Path(os.environ.get("ROLLOUT_GATEWAY_NPM_BIN") or DEFAULT_NPM_BIN) / name
    if not os.access(exe, os.X_OK):
        pytest.fail(f"{exe} does not exist. Install it with `make harnesses` "
                    "(scripts/setup-harnesses.sh) or point ROLLOUT_GATEWAY_NPM_BIN at the "
                    f"folder holding `{name}`.", pytrace=False)
    return exe


def test_codex_exec_on_real_vllm(gateway, tmp_path):
    gw, log = gateway
    traj = "codex-real-" + uuid.uuid4().hex[:8]
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    # the whole config: one model provider and the served model, nothing else
    (home / ".codex" / "config.toml").write_text(
        f'model = "{SERVED_NAME}"\nmodel_provider = "gateway"\n\n'
        f'[model_providers.gateway]\nname = "rollout-gateway"\n'
        f'base_url = "{gw}/t/{traj}/v1"\nwire_api = "responses"\nenv_key = "{KEY_ENV}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CODEX_", "OPENAI_"))}
    env.update(HOME=str(home), **{KEY_ENV: "EMPTY"})
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(_npm_bin("codex")), "exec", "--skip-git-repo-check", "--json", TASK],
        cwd=work, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    said = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert any(e.get("type") == "turn.completed" for e in events), said
    assert not [e for e in events if e.get("type") in ("turn.failed", "error")], said
    _check(gw, log, traj, path="/v1/responses", name="codex exec (real vLLM)", took=took)


def test_claude_code_on_real_vllm(gateway, tmp_path):
    gw, log = gateway
    traj = "claude-real-" + uuid.uuid4().hex[:8]
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(HOME=str(home), ANTHROPIC_BASE_URL=f"{gw}/t/{traj}",
               ANTHROPIC_API_KEY="sk-none")
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(_npm_bin("claude")), "-p", TASK, "--tools", "Bash", "--max-turns", "2",
         "--output-format", "stream-json", "--verbose"],
        cwd=work, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    said = f"rc={proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    final = [e for e in events if e.get("type") == "result"]
    assert len(final) == 1 and not final[0]["is_error"], said
    _check(gw, log, traj, path="/v1/messages", name="claude -p (real vLLM)", took=took)
    print(f"  result: {final[0]['subtype']}, {final[0].get('num_turns')} turns")


# -- the Python harnesses ---------------------------------------------------------------


def test_pydantic_ai_on_real_vllm(gateway):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.vllm import VLLMProvider
    from pydantic_ai.usage import UsageLimits

    gw, log = gateway
    traj = "pydantic-ai-real-" + uuid.uuid4().hex[:8]

    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def run() -> Any:
        model = OpenAIChatModel(SERVED_NAME, provider=VLLMProvider(
            base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY"))
        agent = Agent(model, instructions="Be brief.", tools=[weather],
                      model_settings={"max_tokens": 200})
        async with agent:
            return await agent.run(TASK, usage_limits=UsageLimits(request_limit=4))

    t0 = time.monotonic()
    result = asyncio.run(run())
    took = time.monotonic() - t0
    assert isinstance(result.output, str)
    _check(gw, log, traj, path="/v1/chat/completions", name="pydantic-ai (real vLLM)",
           took=took)


def test_smolagents_on_real_vllm(gateway):
    from smolagents import OpenAIModel, ToolCallingAgent, tool

    gw, log = gateway
    traj = "smolagents-real-" + uuid.uuid4().hex[:8]
    ran: list[str] = []

    @tool
    def weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        ran.append(city)
        return f"sunny in {city}"

    model = OpenAIModel(model_id=SERVED_NAME, api_base=f"{gw}/t/{traj}/v1", api_key="EMPTY",
                        max_tokens=200)
    t0 = time.monotonic()
    try:
        agent = ToolCallingAgent(tools=[weather], model=model, max_steps=3)
        output = agent.run(TASK)
    finally:
        model.client.close()
    took = time.monotonic() - t0
    _, calls = _check(gw, log, traj, path="/v1/chat/completions",
                      name="smolagents (real vLLM)", took=took)
    assert len(calls) <= 3 + 1  # max_steps, then one tool-less call for a final answer
    sent = [body for path, body in log.bodies if path.startswith(f"/t/{traj}/")]
    # every step forces a tool call: guided decoding in the engine
    assert [b.get("tool_choice") for b in sent if b.get("tools")] == ["required"] * len(
        [b for b in sent if b.get("tools")]) != []
    steps = [(type(s).__name__, [tc.name for tc in getattr(s, "tool_calls", None) or ()],
              str(getattr(s, "error", None))[:200]) for s in agent.memory.steps]
    print(f"  steps: {steps}; tool ran on {ran!r:.200}; output {str(output)[:100]!r}")


def test_openai_agents_sdk_on_real_vllm(gateway):
    from agents import (
        Agent,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    gw, log = gateway
    traj = "agents-real-" + uuid.uuid4().hex[:8]

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def run() -> Any:
        async with AsyncOpenAI(base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY") as client:
            set_default_openai_client(client, use_for_tracing=False)
            agent = Agent(name="weather", instructions="Be brief.", model=SERVED_NAME,
                          tools=[weather])
            return await Runner.run(agent, TASK, max_turns=3)

    set_tracing_disabled(True)
    t0 = time.monotonic()
    result = asyncio.run(run())
    took = time.monotonic() - t0
    assert isinstance(result.final_output, str)
    _check(gw, log, traj, path="/v1/responses", name="OpenAI Agents SDK (real vLLM)",
           took=took)


# -- mini-swe-agent, its forks trained whole ------------------------------------------

MINI_STEPS = 4


def test_mini_swe_agent_on_real_vllm(gateway, long_model_dir, tmp_path):
    """mini-swe-agent's ``mini`` CLI as shipped (plus a step limit and ``max_tokens`` 200:
    the random model would otherwise write thousands of tokens now and then). The model
    answers with text, not a tool call, most turns: mini-swe-agent drops each such reply
    and sends a format error instead, so its next call forks a branch. Main must be the
    conversation it ended on (the replies it kept, and the last call), trained whole;
    ``branches=all`` and the prefix tree must hold every generated token once; and the tree
    scored in one forward pass (transformers, float32) must give each generated token the
    logprob its own branch gives it, and close to the engine's."""
    import torch
    from transformers import AutoModelForCausalLM

    from gateway.client import RolloutClient
    from gateway.client.trees import branch_logprobs, tree_logprobs
    from tests.harnesses.mini import rejected_replies, run_mini
    from tests.harnesses.trace import assert_main_is, harness_report

    gw, log = gateway
    traj = "mini-real-" + uuid.uuid4().hex[:8]
    saved, took = run_mini(f"{gw}/t/{traj}/v1", tmp_path, steps=MINI_STEPS,
                           model=SERVED_NAME, settings=["model.model_kwargs.max_tokens=200"],
                           timeout_s=CLI_TIMEOUT_S)
    info = saved["info"]
    # it stops at the step limit, or after three format errors in a row
    n = info["model_stats"]["api_calls"]
    assert info["exit_status"] in ("LimitsExceeded", "RepeatedFormatError") and n >= 3, info
    kept, calls = _check(gw, log, traj, path="/v1/chat/completions",
                         name=f"mini-swe-agent {info['mini_version']} (real vLLM)", took=took)
    assert len(calls) == n and [c["mismatch_pos"] for c in calls] == [None] * n
    rejected = rejected_replies(saved["messages"])
    print(f"  exit {info['exit_status']}; replies rejected: {rejected}")
    assert len(rejected) in (n - 1, n)  # the last reply may end the run unanswered

    # main: every reply mini-swe-agent kept, and the last call's, whole
    assert_main_is(gw, traj, {i for i, r in enumerate(rejected[:n - 1]) if not r} | {n - 1})
    report = harness_report(gw, traj)
    print(f"  {report.line('mini-swe-agent (real vLLM)')}")
    assert report.branches == kept.branches == 1 + sum(rejected[:n - 1])
    assert report.tree_trained == report.generated == kept.generated
    assert report.mismatches == 0

    # the tree in one pass equals each branch on its own, and is the engine's to bf16
    with RolloutClient(gw) as client:
        tree = client.tree(traj)
    model = AutoModelForCausalLM.from_pretrained(long_model_dir, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        once = tree_logprobs(model.eval(), tree)
        apart = branch_logprobs(model, tree)
    trained = [i for i, m in enumerate(tree.loss_mask) if m]
    assert len(trained) == report.generated and all(i in apart for i in trained)
    worst = max(abs(float(once[i]) - apart[i]) for i in apart)
    engine = sum(abs(float(once[i]) - tree.logprobs[i]) for i in trained) / len(trained)
    print(f"  tree: {len(tree.token_ids)} nodes; one pass vs per branch: max |diff| "
          f"{worst:.2e}; vs the engine's (bf16) logprobs: mean |diff| {engine:.3f}")
    assert worst < 1e-4
    assert engine < 0.1  # one token out of place would cost nats, not hundredths
