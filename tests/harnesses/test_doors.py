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

from gateway.errors import BadRequest
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
COMPUTER = {"type": "computer_use_preview", "display_width": 1024, "display_height": 768,
            "environment": "linux"}


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


@pytest.mark.parametrize("stream", [False, True])
def test_responses_with_store_false_are_not_kept(scripted_gateway, stream, closing):
    """``store: false``: the gateway keeps nothing of the response, so a later call cannot
    chain to it, and is answered as OpenAI answers an unknown previous response (404)."""
    traj = _traj()
    client = closing(openai.OpenAI(base_url=f"{scripted_gateway}/t/{traj}/v1", api_key="EMPTY"))
    if stream:
        with client.responses.stream(model=MODEL, input="list the files", store=False) as s:
            first = s.get_final_response()
    else:
        first = client.responses.create(model=MODEL, input="list the files", store=False)
    assert first.status == "completed" and first.store is False and first.output_text
    unknown = _post(scripted_gateway, traj, input="go on", previous_response_id="resp_unknown")
    forgotten = _post(scripted_gateway, traj, input="go on", previous_response_id=first.id)
    assert forgotten.status_code == unknown.status_code == 404, forgotten.text
    want = unknown.json()["error"]
    assert forgotten.json()["error"] == {
        **want, "message": want["message"].replace("resp_unknown", first.id)}
    assert want["param"] == "previous_response_id"
    # stored by default (or when asked): chained
    for store in ({}, {"store": True}):
        kept = client.responses.create(model=MODEL, input="list the files", **store)
        assert kept.store is True
        assert client.responses.create(model=MODEL, input="go on",
                                       previous_response_id=kept.id).status == "completed"
    calls = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"]
    assert len(calls) == 5  # the unkept response's call is recorded like any other


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
    ({"model": MODEL, "input": "x", "tools": [COMPUTER]}, "computer_use_preview"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}],
      "tool_choice": {"type": "web_search"}}, "web_search"),  # dropped: nothing to force
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


def _post(gw: str, traj: str, **body) -> httpx.Response:
    return httpx.post(f"{gw}/t/{traj}/v1/responses", json={"model": MODEL, **body}, timeout=30)


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]


NS_TOOLS = [{"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "close_agent", "description": "Close an agent.",
     "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                    "required": ["target"]}}]},
    {"type": "web_search", "external_web_access": False}, {"type": "file_search"},
    {"type": "code_interpreter", "container": {"type": "auto"}}]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_namespace_tool_flattened_and_hosted_tools_dropped(scripted_gateway, stream):
    """Codex CLI's tool list: a namespace's functions reach the engine as
    ``{namespace}__{name}``, a call comes back with ``name`` and ``namespace`` apart, and
    echoed with its namespace it re-renders to the tokens the model generated; hosted
    tools never reach the engine."""
    traj = _traj()
    r = _post(scripted_gateway, traj, input="close agent x", tools=NS_TOOLS, stream=stream,
              include=["reasoning.encrypted_content"], store=False, reasoning={"summary": "auto"},
              prompt_cache_key="k1", client_metadata={"turn_id": "t1"})
    assert r.status_code == 200, r.text
    final = _sse(r)[-1]["response"] if stream else r.json()
    call = next(o for o in final["output"] if o["type"] == "function_call")
    assert (call["name"], call["namespace"]) == ("close_agent", "agents")
    assert "target" in json.loads(call["arguments"])
    assert final["tools"] == NS_TOOLS and final["store"] is False
    second = _post(scripted_gateway, traj, tools=NS_TOOLS, input=[
        {"role": "user", "content": "close agent x"}, *_said(final),
        {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"}])
    assert second.status_code == 200 and second.json()["output"][0]["type"] == "message"
    text = second.json()["output"][0]["content"][0]["text"]
    check_exact_trace(scripted_gateway, traj,
                      [(_text(final), [("agents__close_agent", call["arguments"])]),
                       (text, [])])


def _said(response: dict) -> list[dict]:
    """The model's turn as a harness echoes it: its messages and calls (a model may say
    a few words before it calls a tool)."""
    return [o for o in response["output"] if o["type"] != "reasoning"]


def _text(response: dict) -> str:
    return "".join(p["text"] for o in response["output"] if o["type"] == "message"
                   for p in o["content"] if p["type"] == "output_text")


def test_responses_custom_tool_round_trip_is_token_exact(scripted_gateway):
    """A freeform (``custom``) tool is one string parameter for the engine; its call comes
    back as a ``custom_tool_call`` with that string, and echoed back it re-renders as the
    model's own arguments."""
    traj = _traj()
    tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]
    first = _post(scripted_gateway, traj, input="patch it", tools=tools).json()
    call = first["output"][-1]
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch"
    assert isinstance(call["input"], str) and call["input"]
    second = _post(scripted_gateway, traj, tools=tools, input=[
        {"role": "user", "content": "patch it"}, *_said(first),
        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "done"}])
    assert second.status_code == 200, second.text
    text = second.json()["output"][0]["content"][0]["text"]
    args = json.dumps({"input": call["input"]})  # what the simulated model generated
    check_exact_trace(scripted_gateway, traj,
                      [(_text(first), [("apply_patch", args)]), (text, [])])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ask", [{"include": ["message.output_text.logprobs"]},
                                 {"top_logprobs": 2}])
def test_responses_output_text_logprobs(scripted_gateway, stream, ask):
    traj = _traj()
    r = _post(scripted_gateway, traj, input="hi", stream=stream, **ask)
    assert r.status_code == 200, r.text
    if stream:
        events = _sse(r)
        deltas = [lp for e in events if e["type"] == "response.output_text.delta"
                  for lp in e["logprobs"]]
        done = next(e for e in events if e["type"] == "response.output_text.done")
        assert deltas == done["logprobs"]
        final = events[-1]["response"]
    else:
        final = r.json()
    part = final["output"][0]["content"][0]
    assert part["logprobs"] and "".join(lp["token"] for lp in part["logprobs"]) == part["text"]
    assert all(lp["logprob"] <= 0 and isinstance(lp["bytes"], list) for lp in part["logprobs"])
    assert {len(lp["top_logprobs"]) for lp in part["logprobs"]} == {ask.get("top_logprobs", 0)}
    recorded = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"][0]
    assert [lp["logprob"] for lp in part["logprobs"]] == pytest.approx(
        recorded["completion_logprobs"][:-1], rel=1e-6)  # all but end-of-turn (stored float32)
    plain = _post(scripted_gateway, _traj(), input="hi").json()  # not asked: none
    assert plain["output"][0]["content"][0]["logprobs"] == []


def test_responses_function_call_output_without_call_id_is_a_400(scripted_gateway):
    traj = _traj()
    r = _post(scripted_gateway, traj, input=[{"role": "user", "content": "go"},
                                             {"type": "function_call_output", "output": "x"}])
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "input[1].call_id" and "call_id" in err["message"]
    assert httpx.get(f"{scripted_gateway}/trajectories/{traj}").status_code == 404


@pytest.mark.parametrize("stream", [False, True])
def test_responses_cut_at_max_output_tokens_is_incomplete_message_too(scripted_gateway, stream):
    r = _post(scripted_gateway, _traj(), input="hi", max_output_tokens=1, stream=stream)
    if stream:
        events = _sse(r)
        assert events[-1]["type"] == "response.incomplete"
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [i["status"] for i in done] == ["incomplete"]
        final = events[-1]["response"]
    else:
        final = r.json()
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(o["type"], o["status"]) for o in final["output"]] == [("message", "incomplete")]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_engine_400_in_the_doors_error_shape(scripted_gateway, stream, closing):
    """A prompt past the context length is the engine's 400: the client gets it as
    OpenAI's invalid_request_error with the engine's message, not as a gateway failure."""
    traj = _traj()
    too_long = "a " * 41_000  # one token per word: more than the server's 40960
    r = _post(scripted_gateway, traj, input=too_long, stream=stream)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "context_length_exceeded"
    assert "maximum context length" in err["message"]
    client = closing(openai.OpenAI(base_url=f"{scripted_gateway}/t/{traj}/v1", api_key="x",
                                   max_retries=0))
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(model=MODEL, input=too_long)


# ---------------------------------------------------------------- Claude Code's wire details
def _chat(body: dict) -> dict:
    return MessagesCall({"model": MODEL, "max_tokens": 64, **body}, ResponseMemory()).chat_body


def test_system_turn_inside_messages_stays_in_place():
    """Claude Code sends its environment as messages[1], a system turn after the first
    user turn (blocks one call, a string the next): it stays a system message there, so
    the prompt only grows at its end."""
    env = "# Environment\ncwd: /w"
    for content in (env, [{"type": "text", "text": env, "cache_control": {"type": "ephemeral"}}]):
        chat = _chat({"system": "Be brief.", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<reminder>\n"},
                                         {"type": "text", "text": "list the files"}]},
            {"role": "system", "content": content}]})
        assert chat["messages"] == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "<reminder>\nlist the files"},
                                    {"role": "system", "content": env}]


def test_billing_header_block_is_not_prompt_text_and_cache_control_is_ignored():
    chat = _chat({"system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=9.9.9; cc_entrypoint=cli;"},
        {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": " Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": "hi"}]})
    assert chat["messages"][0] == {"role": "system", "content": "You are an agent. Be brief."}


def test_thinking_effort_context_management_and_metadata_are_accepted_and_ignored():
    chat = _chat({
        "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": '{"session_id": "s"}'},
        "messages": [{"role": "user", "content": "go"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                         {"type": "redacted_thinking", "data": "xx"},
                         {"type": "text", "text": "done"}]},
                     {"role": "user", "content": "ok"}]})
    assert set(chat) == {"model", "messages", "max_tokens"}
    assert chat["messages"][1] == {"role": "assistant", "content": "done"}


def test_tool_result_with_cache_control_and_error_flag_false():
    chat = _chat({"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu1", "name": "bash",
                                           "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"tool_use_id": "tu1", "type": "tool_result",
                                      "content": "(no output)", "is_error": False,
                                      "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{**ANT_TOOL, "cache_control": {"type": "ephemeral"}}]})
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "tu1",
                                    "content": "(no output)"}
    assert chat["tools"][0]["function"]["name"] == "bash"


def test_deferred_tools_stay_out_of_the_tool_list_and_load_where_referenced():
    """Client-side tool search: a ``defer_loading`` tool is not in the engine's tool list
    (the head of the prompt); a tool_reference to it shows its definition in the tool
    result, so loading a tool only appends to the prompt."""
    fetch = {"name": "WebFetch", "description": "fetch a URL", "defer_loading": True,
             "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}}}
    placeholder = {"name": "DeferredToolPlaceholder", "defer_loading": True,
                   "input_schema": {"type": "object", "properties": {}}}
    search = {"name": "ToolSearch", "input_schema": {"type": "object", "properties": {
        "query": {"type": "string"}}}}
    chat = _chat({"tools": [search, fetch, placeholder, ANT_TOOL], "messages": [
        {"role": "user", "content": "fetch it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu1", "name": "ToolSearch",
                                           "input": {"query": "select:WebFetch"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": [
            {"type": "tool_reference", "tool_name": "WebFetch"}]}]}]})
    assert [t["function"]["name"] for t in chat["tools"]] == ["ToolSearch", "bash"]
    loaded = json.loads(chat["messages"][-1]["content"])
    assert loaded == {"type": "function", "function": {
        "name": "WebFetch", "parameters": fetch["input_schema"], "description": "fetch a URL"}}
    with pytest.raises(BadRequest, match="Nope"):
        _chat({"tools": [search], "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [
                {"type": "tool_reference", "tool_name": "Nope"}]}]}]})


def test_disable_parallel_tool_use():
    chat = _chat({"tools": [ANT_TOOL], "messages": [{"role": "user", "content": "go"}],
                  "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False


def test_stream_message_start_carries_the_prompt_length_from_the_first_chunk():
    """The engine's first chunk holds the prompt ids (asked for by the door): their count
    is message_start's input_tokens; message_delta repeats it with the output count."""
    call = MessagesCall({"model": MODEL, "max_tokens": 8, "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]}, ResponseMemory())
    assert call.chat_body["return_token_ids"] is True
    out = call.event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                      "prompt_token_ids": list(range(17))})
    out += call.event({"choices": [{"index": 0, "delta": {"content": "yo"}, "token_ids": [5],
                                    "finish_reason": "stop"}]})
    out += call.event({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": 1}})
    out += call.done()
    events = {e.split(b"\n")[0][7:].decode(): json.loads(e.split(b"\n")[1][6:])
              for e in out.split(b"\n\n") if e}
    assert events["message_start"]["message"]["usage"] == {"input_tokens": 17, "output_tokens": 0}
    assert events["message_delta"]["usage"] == {"input_tokens": 17, "output_tokens": 1}
    assert b"token_ids" not in out


def test_streamed_input_tokens_are_the_recorded_prompt_length(scripted_gateway, closing):
    traj = _traj()
    client = closing(anthropic.Anthropic(base_url=f"{scripted_gateway}/t/{traj}", api_key="x"))
    with client.messages.stream(model=MODEL, max_tokens=64, system="Be brief.", messages=[
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "cwd: /w"}]) as stream:
        start = next(e for e in stream if e.type == "message_start")
        final = stream.get_final_message()
    call = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"][0]
    assert start.message.usage.input_tokens == call["prompt_len"] > 0
    assert final.usage.input_tokens == call["prompt_len"]
    assert final.usage.output_tokens == len(call["completion_ids"])


@pytest.mark.parametrize("stream", [False, True])
def test_context_overflow_reaches_the_client_in_anthropic_shape(scripted_gateway, stream,
                                                                closing):
    """A prompt the engine's context cannot hold: the engine's own message, as Anthropic's
    invalid_request_error, streamed or not."""
    body = {"model": MODEL, "max_tokens": 64, "stream": stream,
            # a token per digit, as Qwen3 counts them: 48k tokens over the 40,960 context
            "messages": [{"role": "user", "content": "12345 " * 8000}]}
    r = httpx.post(f"{scripted_gateway}/t/{_traj()}/v1/messages", json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "maximum context length" in err["error"]["message"]
    client = closing(anthropic.Anthropic(base_url=f"{scripted_gateway}/t/{_traj()}",
                                         api_key="x", max_retries=0))
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        client.messages.create(**body)


def test_count_tokens_is_the_engines_count_of_the_prompt_messages_would_run(
        scripted_gateway, closing):
    """Claude Code counts tokens for some features (``/context``): the answer is the
    engine's count of the prompt ``/v1/messages`` runs for the same body, and nothing is
    recorded."""
    traj = _traj()
    client = closing(anthropic.Anthropic(base_url=f"{scripted_gateway}/t/{traj}",
                                         api_key="x", max_retries=0))
    body = {"model": MODEL, "system": "Be brief.", "tools": [ANT_TOOL],
            "messages": [{"role": "user", "content": "list the files"}]}
    counted = client.messages.count_tokens(**body)
    assert httpx.get(f"{scripted_gateway}/trajectories/{traj}").status_code == 404
    client.messages.create(max_tokens=20, **body)
    (call,) = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()["calls"]
    assert counted.input_tokens == call["prompt_len"] > 0
    r = httpx.post(f"{scripted_gateway}/v1/messages/count_tokens",
                   json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error"
    r = httpx.post(f"{scripted_gateway}/v1/messages/batches", json={})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
