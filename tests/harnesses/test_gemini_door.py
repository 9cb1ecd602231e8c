"""The Gemini API door with Google's own SDK (google-genai), token capture exact.

``generateContent``, ``streamGenerateContent`` (``alt=sse`` as the SDK asks, and the
JSON-array form without it), ``countTokens`` and a two-turn function-calling exchange
against a scripted simulated server; errors in Google's envelope; roles as on every
model route. The translation itself (ids, pairing, schemas) is checked on its own at the
end.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import orjson
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from gateway.errors import BadRequest
from gateway.proxy.doors.gemini import GeminiCall
from gateway.proxy.doors.memory import ResponseMemory
from tests.harnesses.conftest import MODEL, check_exact_trace
from tests.harnesses.trace import assert_exact_trace

TRAINER, HARNESS = "tr-Secret-g1", "hk-Secret-g2"
BASH = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="bash", description="run a shell command",
    parameters_json_schema={"type": "object", "properties": {"cmd": {"type": "string"}},
                            "required": ["cmd"]})])


def _tid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@contextmanager
def _client(base_url: str, key: str = "sk-none") -> Iterator[genai.Client]:
    with genai.Client(api_key=key, http_options=types.HttpOptions(
            base_url=base_url, retry_options=types.HttpRetryOptions(attempts=1))) as client:
        yield client


def _text(response: types.GenerateContentResponse) -> str:
    parts = response.candidates[0].content.parts or []
    return "".join(p.text for p in parts if p.text)


def _one_branch(gw: str, traj: str) -> None:
    samples = httpx.get(f"{gw}/trajectories/{traj}/samples", timeout=10).json()["data"]
    assert len(samples) == 1, [s["branch"] for s in samples]


def test_generate_then_stream_continues_one_branch(scripted_gateway):
    gw, traj = scripted_gateway, _tid("gem")
    config = types.GenerateContentConfig(system_instruction="Be brief.",
                                         max_output_tokens=200, temperature=0.7)
    with _client(f"{gw}/t/{traj}") as client:
        first = client.models.generate_content(model=MODEL, contents="Say hi", config=config)
        assert _text(first) and first.candidates[0].finish_reason == types.FinishReason.STOP
        assert first.model_version == MODEL and first.response_id
        usage = first.usage_metadata
        assert usage.prompt_token_count > 0 and usage.candidates_token_count > 0
        assert usage.total_token_count == usage.prompt_token_count + usage.candidates_token_count
        history = [types.Content(role="user", parts=[types.Part(text="Say hi")]),
                   first.candidates[0].content,
                   types.Content(role="user", parts=[types.Part(text="Once more")])]
        chunks = list(client.models.generate_content_stream(model=MODEL, contents=history,
                                                            config=config))
    text = "".join(c.text or "" for c in chunks)
    assert text and len(chunks) >= 2  # text, then the finish (and usage)
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert chunks[-1].usage_metadata.candidates_token_count > 0
    calls = assert_exact_trace(gw, traj, calls=2, texts=[_text(first), text])
    assert {c["endpoint"] for c in calls} == {"gemini"}
    _one_branch(gw, traj)


def test_function_calling_two_turns_exact(scripted_gateway):
    """Turn 0 calls the tool (the server's script), turn 1 answers its result in text:
    every generated token in one branch, the second call continuing the first."""
    gw, traj = scripted_gateway, _tid("gemfn")
    config = types.GenerateContentConfig(tools=[BASH], max_output_tokens=300)
    with _client(f"{gw}/g/grp-{traj}/t/{traj}") as client:
        ask = types.Content(role="user", parts=[types.Part(text="tests fail; fix them")])
        first = client.models.generate_content(model=MODEL, contents=[ask], config=config)
        (call,) = first.function_calls
        assert call.name == "bash" and isinstance(call.args, dict) and call.id
        answer = types.Content(role="user", parts=[types.Part(
            function_response=types.FunctionResponse(id=call.id, name="bash",
                                                     response={"output": "1 passed"}))])
        history = [ask, first.candidates[0].content, answer]
        chunks = list(client.models.generate_content_stream(model=MODEL, contents=history,
                                                            config=config))
    text = "".join(c.text or "" for c in chunks)
    assert text and not any(c.function_calls for c in chunks)
    check_exact_trace(gw, traj, [(_text(first), [("bash", json.dumps(call.args))]),
                                 (text, [])])
    detail = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json()
    assert [c["finish_reason"] for c in detail["calls"]] == ["tool_calls", "stop"]
    _one_branch(gw, traj)


def test_count_tokens_is_the_prompt_generate_runs(scripted_gateway):
    gw = scripted_gateway
    contents = "How many tokens is this?"
    with _client(f"{gw}/t/{_tid('count')}") as client:
        counted = client.models.count_tokens(model=MODEL, contents=contents).total_tokens
        ran = client.models.generate_content(model=MODEL, contents=contents)
    assert counted == ran.usage_metadata.prompt_token_count > 0
    traj = _tid("countonly")  # a count runs no model call: nothing is recorded
    r = httpx.post(f"{gw}/t/{traj}/v1beta/models/{MODEL}:countTokens",
                   json={"contents": [{"role": "user", "parts": [{"text": contents}]}]})
    assert r.json() == {"totalTokens": counted}
    r = httpx.post(f"{gw}/t/{traj}/v1beta/models/{MODEL}:countTokens", json={
        "generateContentRequest": {"contents": [{"parts": [{"text": contents}]}]}})
    assert r.json() == {"totalTokens": counted}
    assert httpx.get(f"{gw}/trajectories/{traj}").status_code == 404


def test_stream_without_alt_sse_is_a_json_array(scripted_gateway):
    gw, traj = scripted_gateway, _tid("arr")
    r = httpx.post(f"{gw}/t/{traj}/v1beta/models/{MODEL}:streamGenerateContent",
                   json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    responses = r.json()
    assert isinstance(responses, list) and len(responses) > 1
    text = "".join(p.get("text", "") for resp in responses
                   for p in resp["candidates"][0]["content"]["parts"])
    assert responses[-1]["candidates"][0]["finishReason"] == "STOP"
    assert_exact_trace(gw, traj, calls=1, texts=[text])


def _google_error(r: httpx.Response, code: int, status: str) -> str:
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert (err["code"], err["status"]) == (code, status) and set(err) == {
        "code", "message", "status"}
    return str(err["message"])


@pytest.mark.parametrize(("body", "says"), [
    ({}, "contents"),
    ({"contents": [{"role": "user", "parts": [
        {"inlineData": {"mimeType": "image/png", "data": "AAAA"}}]}]}, "inlineData"),
    ({"contents": [{"role": "tool", "parts": [{"text": "x"}]}]}, "role"),
    ({"contents": [{"parts": [{"text": "x"}]}], "tools": [{"computerUse": {}}]}, "computerUse"),
    ({"contents": [{"parts": [{"text": "x"}]}],
      "generationConfig": {"maxOutputTokens": 0}}, "maxOutputTokens"),
])
def test_bad_bodies_get_googles_400_and_no_trace(scripted_gateway, body, says):
    gw, traj = scripted_gateway, _tid("bad")
    for method in ("generateContent", "streamGenerateContent?alt=sse"):
        r = httpx.post(f"{gw}/t/{traj}/v1beta/models/{MODEL}:{method}", json=body)
        assert says in _google_error(r, 400, "INVALID_ARGUMENT")
    r = httpx.post(f"{gw}/t/{traj}/v1beta/models/{MODEL}:generateContent", content=b"{nope")
    _google_error(r, 400, "INVALID_ARGUMENT")
    assert httpx.get(f"{gw}/trajectories/{traj}").status_code == 404
    with _client(f"{gw}/t/{traj}") as client, pytest.raises(genai_errors.ClientError) as exc:
        client.models.generate_content(model=MODEL, contents=[types.Part.from_bytes(
            data=b"\x89PNG", mime_type="image/png")])
    assert exc.value.code == 400 and "inlineData" in str(exc.value.message)


def test_an_engine_4xx_keeps_its_message_in_googles_shape(scripted_gateway):
    """A prompt past the engine's context: the engine's 400, its message kept."""
    gw, traj = scripted_gateway, _tid("ctx")
    body = {"contents": [{"parts": [{"text": "lorem ipsum dolor " * 40000}]}]}
    for method in ("generateContent", "streamGenerateContent?alt=sse"):
        r = httpx.post(f"{gw}/t/{traj}/v1beta/models/{MODEL}:{method}", json=body, timeout=60)
        assert "maximum context length" in _google_error(r, 400, "INVALID_ARGUMENT")


def test_unknown_model_and_unknown_route_are_googles_404(scripted_gateway):
    gw = scripted_gateway
    body = {"contents": [{"parts": [{"text": "hi"}]}]}
    for method in ("generateContent", "streamGenerateContent?alt=sse", "countTokens"):
        r = httpx.post(f"{gw}/t/{_tid('nomodel')}/v1beta/models/gemini-9-ultra:{method}",
                       json=body)
        assert "gemini-9-ultra" in _google_error(r, 404, "NOT_FOUND")
    _google_error(httpx.get(f"{gw}/v1beta/models"), 404, "NOT_FOUND")
    r = httpx.post(f"{gw}/t/bad%20id/v1beta/models/{MODEL}:generateContent", json=body)
    _google_error(r, 400, "INVALID_ARGUMENT")
    with _client(gw) as client, pytest.raises(genai_errors.ClientError) as exc:
        client.models.generate_content(model="gemini-9-ultra", contents="hi")
    assert exc.value.code == 404 and exc.value.status == "NOT_FOUND"


def test_roles_and_the_goog_key(gateway_at, sim_pool, sqlite_url):
    """``x-goog-api-key`` is the credential: none is 401, a key for another trajectory
    403 (before the body is read); a scoped key on the plain path tags its trajectory."""
    body = {"contents": [{"parts": [{"text": "hi"}]}],
            "generationConfig": {"maxOutputTokens": 8}}
    with gateway_at(sqlite_url, sim_pool, trainer_token=TRAINER, api_keys=[HARNESS]) as gw:
        scoped = httpx.post(f"{gw}/trajectories/mine/key",
                            headers={"Authorization": f"Bearer {TRAINER}"}).json()["key"]
        url = f"{gw}/t/victim/v1beta/models/{MODEL}:generateContent"
        _google_error(httpx.post(url, json=body), 401, "UNAUTHENTICATED")
        r = httpx.post(url, json=body, headers={"x-goog-api-key": scoped})
        assert "victim" in _google_error(r, 403, "PERMISSION_DENIED")
        r = httpx.post(f"{gw}/t/victim/v1beta/models/{MODEL}:countTokens", json=body,
                       headers={"x-goog-api-key": scoped})
        _google_error(r, 403, "PERMISSION_DENIED")
        with _client(f"{gw}/t/victim", key=scoped) as client, \
                pytest.raises(genai_errors.ClientError) as exc:
            client.models.generate_content(model=MODEL, contents="hi")
        assert exc.value.code == 403
        with _client(gw, key=scoped) as client:
            client.models.generate_content(
                model=MODEL, contents="hi",
                config=types.GenerateContentConfig(max_output_tokens=8))
        with _client(f"{gw}/t/anyone", key=HARNESS) as client:
            client.models.generate_content(
                model=MODEL, contents="hi",
                config=types.GenerateContentConfig(max_output_tokens=8))
        trainer = {"Authorization": f"Bearer {TRAINER}"}
        for traj in ("mine", "anyone"):
            calls = httpx.get(f"{gw}/trajectories/{traj}", headers=trainer).json()["calls"]
            assert [c["endpoint"] for c in calls] == ["gemini"]


# ---------------------------------------------------------------- the translation alone
def _chat(contents: list[dict], memory: ResponseMemory | None = None, **body: object) -> dict:
    return GeminiCall({"model": MODEL, "contents": contents, **body},
                      ResponseMemory() if memory is None else memory, stream=False).chat_body


def test_calls_without_ids_pair_by_name_and_position_deterministically():
    contents = [
        {"role": "user", "parts": [{"text": "go"}, {"text": "now"}]},
        {"role": "model", "parts": [{"text": "ok"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "a", "args": {"x": 1}}},
                                    {"functionCall": {"name": "b", "args": {}}},
                                    {"thought": True, "text": "hmm"}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "b", "response": {"output": "B"}}},
            {"functionResponse": {"name": "a", "response": {"error": "boom"}}}]},
    ]
    chat = _chat(contents)
    assert chat == _chat(json.loads(json.dumps(contents)))  # the same ids on every re-send
    user, model, b, a = chat["messages"]
    assert user == {"role": "user", "content": "go\nnow"}
    assert model["content"] == "ok" and [c["id"] for c in model["tool_calls"]] == [
        "call_2_0", "call_2_1"]
    assert model["tool_calls"][0]["function"] == {"name": "a", "arguments": '{"x":1}'}
    assert b == {"role": "tool", "tool_call_id": "call_2_1", "content": "B"}
    assert a == {"role": "tool", "tool_call_id": "call_2_0", "content": '{"error":"boom"}'}


def test_generated_arguments_come_back_as_written():
    memory = ResponseMemory()
    door = GeminiCall({"model": MODEL, "contents": [{"parts": [{"text": "hi"}]}]}, memory,
                      stream=False)
    raw = '{"cmd":   "ls",  "n": 2}'
    answer = orjson.loads(door.whole({"choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"content": None, "tool_calls": [
            {"id": "t1", "function": {"name": "bash", "arguments": raw}}]}}]}))
    part = answer["candidates"][0]["content"]["parts"][0]["functionCall"]
    assert part == {"id": "t1", "name": "bash", "args": {"cmd": "ls", "n": 2}}
    for echoed in (part, {"name": "bash", "args": {"n": 2, "cmd": "ls"}},  # id renamed
                   {"id": "bash__t1", "name": "bash", "args": {"cmd": "ls", "n": 2}}):
        chat = _chat([{"parts": [{"text": "hi"}]}, {"role": "model", "parts": [
            {"functionCall": echoed}]}], memory)
        assert chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == raw


def test_tools_config_and_schemas():
    chat = _chat([{"parts": [{"text": "hi"}]}],
                 system_instruction={"parts": [{"text": "sys"}]},
                 tools=[{"function_declarations": [{"name": "f", "parameters": {
                     "type": "OBJECT", "properties": {"type": {"type": "STRING"},
                                                      "xs": {"type": "ARRAY", "items": {
                                                          "type": "INTEGER"}}}}}]},
                        {"googleSearch": {}}],
                 toolConfig={"functionCallingConfig": {"mode": "ANY",
                                                       "allowedFunctionNames": ["f"]}},
                 generationConfig={"topP": 0.9, "topK": 5, "seed": 3, "candidateCount": 2,
                                   "stopSequences": ["END"],
                                   "responseMimeType": "application/json",
                                   "responseJsonSchema": {"type": "object"},
                                   "thinkingConfig": {"thinkingBudget": 0}})
    assert chat["messages"][0] == {"role": "system", "content": "sys"}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"type": {"type": "string"}, "xs": {
            "type": "array", "items": {"type": "integer"}}}}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert (chat["top_p"], chat["top_k"], chat["seed"], chat["n"], chat["stop"]) == (
        0.9, 5, 3, 2, ["END"])
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "response", "schema": {"type": "object"}}}
    for mode, choice in (("AUTO", "auto"), ("NONE", "none"), ("ANY", "required")):
        assert _chat([{"parts": [{"text": "hi"}]}], tools=[BASH.model_dump(
            mode="json", by_alias=True, exclude_none=True)], toolConfig={
            "functionCallingConfig": {"mode": mode}})["tool_choice"] == choice
    with pytest.raises(BadRequest, match="fileData"):
        _chat([{"parts": [{"fileData": {"fileUri": "gs://x"}}]}])
