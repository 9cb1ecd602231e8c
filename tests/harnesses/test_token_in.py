"""Turns kept as generated: a harness that re-renders the model's earlier turn still gets
the engine run on the model's own tokens, and the sample keeps every generated token.

The simulated engine renders a tool call's ``arguments`` verbatim, so a client that
re-serializes them (``{"cmd":"x"}`` for the model's ``{"cmd": "x"}``, as pydantic-ai does)
sends a conversation whose rendering leaves the recorded tokens: the drift that used to
cut the model's turn from the sample.
"""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from backends.sim.tokenizer import get_tokenizer
from tests.harnesses.conftest import MODEL
from tests.harnesses.trace import assert_every_token_kept

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                   "required": ["cmd"]}}}]


def _compact(message) -> dict:
    """The assistant turn as a harness that re-serializes tool arguments echoes it."""
    return {"role": "assistant", "content": message.content, "tool_calls": [
        {"id": c.id, "type": "function", "function": {
            "name": c.function.name,
            "arguments": json.dumps(json.loads(c.function.arguments), separators=(",", ":"))}}
        for c in message.tool_calls]}


def _run(gw: str, traj: str, *, stream: bool) -> list:
    client = openai.OpenAI(base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "list the files"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    turn = first.choices[0].message
    assert turn.tool_calls and "\": " in turn.tool_calls[0].function.arguments  # spaced
    messages += [_compact(turn),
                 {"role": "tool", "tool_call_id": turn.tool_calls[0].id, "content": "a.py"}]
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                     tools=TOOLS, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(model=MODEL, messages=messages,
                                              tools=TOOLS).choices[0].message.content
    client.close()
    return [first, text]


@pytest.mark.parametrize("stream", [False, True])
def test_reserialized_tool_arguments_keep_every_generated_token(scripted_gateway, stream):
    traj = f"tin-{uuid.uuid4().hex[:8]}"
    _, text = _run(scripted_gateway, traj, stream=stream)
    calls = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"]
    first, second = calls
    recorded = first["prompt_len"] + len(first["completion_ids"])
    assert second["kept_len"] == recorded and second["mismatch_pos"] is None
    assert second["branch"] == first["branch"] == 0 and second["prompt_offset"] == recorded
    # the engine ran on the model's own turn: the harness's compact JSON is not in it
    tok = get_tokenizer()
    assert '{"cmd":' not in tok.decode(second["prompt_delta_ids"])
    assert text and text in tok.decode(second["completion_ids"])  # what the client saw
    samples = httpx.get(f"{scripted_gateway}/trajectories/{traj}/samples").json()["data"]
    assert len(samples) == 1
    (sample,) = samples
    generated = first["completion_ids"] + second["completion_ids"]
    kept = [t for t, m in zip(sample["token_ids"], sample["loss_mask"], strict=True) if m]
    assert kept == generated  # 100% of the generated tokens, in order, under loss mask 1
    lps = [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True) if m]
    assert lps == first["completion_logprobs"] + second["completion_logprobs"]


def test_token_in_off_reports_the_drift_as_a_branch_with_a_mismatch(
        loop_thread, tmp_path_factory):
    """With ``capture.token_in`` off the engine runs the harness's rendering: the call
    forks a branch from the turn it re-rendered, and the mismatch is recorded."""
    from contextlib import ExitStack

    from backends.sim.runner import start_sim_servers
    from backends.sim.state import SimServerConfig
    from gateway.app import create_app
    from tests.gateway.conftest import make_settings
    from tests.servers import app_in_thread

    cm = start_sim_servers([SimServerConfig(model=MODEL, speed=50, seed=7,
                                            output_len_median=20, tool_script=(True,))])
    urls = loop_thread.run(cm.__aenter__())
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('off') / 'gw.db'}"
    settings = make_settings(db, urls)
    settings.capture.token_in = False
    traj = f"off-{uuid.uuid4().hex[:8]}"
    try:
        with ExitStack() as stack:
            gw = stack.enter_context(app_in_thread(loop_thread, lambda: create_app(settings)))
            _run(gw, traj, stream=False)
            first, second = httpx.get(f"{gw}/trajectories/{traj}").json()["calls"]
            samples = httpx.get(f"{gw}/trajectories/{traj}/samples").json()["data"]
    finally:
        loop_thread.run(cm.__aexit__(None, None, None))
    assert second["kept_len"] is None
    assert (second["branch"], second["parent_branch"]) == (1, 0)
    assert first["prompt_len"] < second["mismatch_pos"] == second["prompt_offset"]
    assert [s["branch"] for s in samples] == [0, 1]
    assert samples[1]["mismatches"][0]["seq"] == 1
    # nothing lost: the drifted branch is where the harness went on (main), and trains
    # the first turn's tokens up to the drift with its own; the first branch trains the
    # rest of its turn
    inherited = second["mismatch_pos"] - first["prompt_len"]
    assert samples[1]["main"] and not samples[0]["main"]
    assert sum(samples[1]["loss_mask"]) == inherited + len(second["completion_ids"])
    assert sum(samples[0]["loss_mask"]) == len(first["completion_ids"]) - inherited


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_the_context_is_clamped_to_what_the_prompt_leaves(
        scripted_gateway, key):
    """Claude Code asks for 32,000 tokens whatever its prompt: the engine would answer 400
    (prompt + max_tokens over the context); the gateway lowers it to the room left."""
    traj = f"clamp-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{scripted_gateway}/t/{traj}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], key: 10**6})
    assert r.status_code == 200, r.text
    (call,) = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"]
    assert call["status"] == "ok"  # unclamped, the simulated engine answers 400 (as vLLM)
    assert call["prompt_len"] + len(call["completion_ids"]) <= 40960  # its max_model_len


def test_an_edited_turn_is_a_branch_not_a_mismatch(scripted_gateway):
    """A harness that drops the model's tool call from its echo (as smolagents does after
    a tool error) changed the history: the engine runs the harness's version, the call
    opens a branch, and no mismatch is reported (that word is for failed joins)."""
    traj = f"edit-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(base_url=f"{scripted_gateway}/t/{traj}/v1", api_key="EMPTY",
                           max_retries=0)
    messages = [{"role": "user", "content": "list the files"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert first.choices[0].message.tool_calls
    messages += [{"role": "assistant", "content": ""},
                 {"role": "user", "content": "Error: the tool call was malformed"}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    client.close()
    first_call, second = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"]
    assert second["kept_len"] is None and second["mismatch_pos"] is None
    assert (second["branch"], second["parent_branch"]) == (1, 0)
    assert second["prompt_offset"] <= first_call["prompt_len"]
    assert assert_every_token_kept(scripted_gateway, traj).branches == 2
