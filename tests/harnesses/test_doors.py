"""``/v1/responses`` and ``/v1/messages`` through the openai and anthropic SDKs: plain,
streaming, tool calls, multi-turn, every tagging form, errors in each API's own shape,
and exact token traces."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from gateway.proxy.doors.memory import ResponseMemory
from gateway.proxy.doors.messages import MessagesCall
from gateway.trajectories.tools import parse_outcomes
from tests.harnesses.conftest import MODEL, check_exact_trace

FN_TOOL = {"type": "function", "name": "bash", "description": "run a shell command",
           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                          "required": ["cmd"]}}
ANT_TOOL = {"name": "bash", "description": "run a shell command",
            "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}},
                             "required": ["cmd"]}}


def _traj() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def _responses_seen(resp) -> tuple[str, list[tuple[str, str]]]:
    return resp.output_text, [(o.name, o.arguments) for o in resp.output
                              if o.type == "function_call"]


@pytest.mark.parametrize("chain", ["previous_response_id", "full_input"])
def test_responses_tool_turn_then_text(scripted_gateway, chain, closing):
    traj = _traj()
    client = closing(openai.OpenAI(base_url=f"{scripted_gateway}/t/{traj}/v1", api_key="EMPTY"))
    first = client.responses.create(model=MODEL, instructions="Be brief.",
                                    input="list the files", tools=[FN_TOOL])
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "bash" and first.status == "completed"
    assert "cmd" in json.loads(calls[0].arguments)
    assert first.usage.output_tokens > 0
    outputs = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.py"}]
    if chain == "previous_response_id":
        second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                         instructions="Be brief.", input=outputs,
                                         tools=[FN_TOOL])
    else:
        history = [{"role": "user", "content": "list the files"},
                   *[o.model_dump(exclude_none=True) for o in first.output], *outputs]
        second = client.responses.create(model=MODEL, instructions="Be brief.",
                                         input=history, tools=[FN_TOOL])
    assert second.output_text and not [o for o in second.output if o.type == "function_call"]
    check_exact_trace(scripted_gateway, traj, [_responses_seen(first), _responses_seen(second)])


def test_responses_streaming_events(scripted_gateway, closing):
    traj = _traj()
    client = closing(openai.OpenAI(base_url=f"{scripted_gateway}/v1", api_key="EMPTY",
                                   default_headers={"X-Trajectory-Id": traj}))
    kinds, deltas, args = [], [], []
    with client.responses.stream(model=MODEL, input="hi", tools=[FN_TOOL]) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                args.append(event.delta)
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    call = next(o for o in final.output if o.type == "function_call")
    assert "".join(args) == call.arguments
    with client.responses.stream(model=MODEL, previous_response_id=final.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}],
            tools=[FN_TOOL]) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        second = stream.get_final_response()
    assert "".join(deltas) == second.output_text != ""
    check_exact_trace(scripted_gateway, traj, [_responses_seen(final), _responses_seen(second)])


def _ant_seen(msg) -> tuple[str, list[tuple[str, str]]]:
    text = "".join(b.text for b in msg.content if b.type == "text")
    return text, [(b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tools_and_streaming(scripted_gateway, stream, closing):
    traj = _traj()
    client = closing(anthropic.Anthropic(base_url=f"{scripted_gateway}/g/grp-1/t/{traj}",
                                         api_key="EMPTY"))
    msgs = [{"role": "user", "content": "list the files"}]

    def ask():
        if not stream:
            return client.messages.create(model=MODEL, max_tokens=256, system="Be brief.",
                                          messages=msgs, tools=[ANT_TOOL])
        with client.messages.stream(model=MODEL, max_tokens=256, system="Be brief.",
                                    messages=msgs, tools=[ANT_TOOL]) as s:
            return s.get_final_message()

    first = ask()
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "bash" and "cmd" in use.input
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                               for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "permission denied", "is_error": True}]}]
    second = ask()
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    check_exact_trace(scripted_gateway, traj, [_ant_seen(first), _ant_seen(second)])
    detail = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()
    assert detail["group_id"] == "grp-1"


def test_is_error_tool_result_counts_as_a_failure():
    """A tool_result with is_error=true is a failure for tool-outcome tracking even when
    its text looks harmless."""
    call = MessagesCall({"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu1", "name": "bash",
                                           "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                      "content": "permission denied", "is_error": True}]},
    ]}, ResponseMemory())
    plain = parse_outcomes(call.chat_body["messages"])
    assert [o.state for o in plain] == ["bash:small:success"]  # the text alone looks fine
    assert [o.state for o in call.adjust_outcomes(plain)] == ["bash:small:failure"]


def test_x_api_key_tags_the_trajectory(scripted_gateway):
    traj = _traj()
    r = httpx.post(f"{scripted_gateway}/v1/messages", headers={"x-api-key": traj}, json={
        "model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["x-trajectory-id"] == traj
    body = r.json()
    assert body["type"] == "message" and set(body) == {
        "id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "'image'"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
     "max_tokens"),
    ("/v1/messages", {"model": "nope", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "x"}]}, "nope"),
])
def test_messages_errors_in_anthropic_shape(scripted_gateway, path, body, needle):
    traj = _traj()
    r = httpx.post(f"{scripted_gateway}/t/{traj}{path}", json=body)
    assert 400 <= r.status_code < 500
    err = r.json()
    assert err["type"] == "error" and needle in err["error"]["message"]
    assert httpx.get(f"{scripted_gateway}/trajectories/{traj}").status_code == 404  # no half trace


@pytest.mark.parametrize(("body", "needle"), [
    ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input_image"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_missing"}, "resp_missing"),
    ({"model": MODEL}, "input"),
])
def test_responses_errors_in_openai_shape(scripted_gateway, body, needle, closing):
    traj = _traj()
    r = httpx.post(f"{scripted_gateway}/t/{traj}/v1/responses", json=body)
    assert r.status_code in (400, 404)  # an unknown previous response is a 404, as at OpenAI
    assert needle in r.json()["error"]["message"]
    assert httpx.get(f"{scripted_gateway}/trajectories/{traj}").status_code == 404
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
        closing(openai.OpenAI(base_url=f"{scripted_gateway}/t/{traj}/v1", api_key="x")
                ).responses.create(**body)
