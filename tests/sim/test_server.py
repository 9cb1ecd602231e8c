"""The simulated server through real sockets and the official OpenAI client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from gateway.pool.monitor import parse_vllm_metrics

MODEL = "qwen3-14b"
TOOLS = [{"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}}}}]


@pytest.fixture
async def urls() -> AsyncIterator[list[str]]:
    configs = [SimServerConfig(speed=50, seed=i, tick_real_s=0.005) for i in range(4)]
    async with start_sim_servers(configs) as found:
        yield found


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_openai_client_streams_from_four_servers(urls: list[str]) -> None:
    async def stream(url: str) -> tuple[list[int], list[int], str, Any]:
        prompt_ids: list[int] = []
        ids: list[int] = []
        text, usage = "", None
        async with _client(url) as client:
            s = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], stream=True,
                max_tokens=40, stream_options={"include_usage": True},
                extra_body={"return_token_ids": True, "ignore_eos": True})
            async for chunk in s:
                extra = chunk.model_extra or {}
                prompt_ids += extra.get("prompt_token_ids") or []
                for ch in chunk.choices:
                    ids += (ch.model_extra or {}).get("token_ids") or []
                    text += ch.delta.content or ""
                usage = chunk.usage or usage
        return prompt_ids, ids, text, usage

    results = await asyncio.gather(*(stream(u) for u in urls))
    for prompt_ids, ids, text, usage in results:
        assert len(ids) == 40 == usage.completion_tokens
        assert len(prompt_ids) == usage.prompt_tokens > 0
        assert len(text.split()) == 40
    assert len({tuple(r[1]) for r in results}) == 4  # different seeds, different text


async def test_multi_turn_tool_calls_round_trip_token_exactly(urls: list[str]) -> None:
    async with _client(urls[0]) as client:
        await _tool_turns(client)


async def _tool_turns(client: AsyncOpenAI) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "find the bug"}]
    prev: list[int] = []
    for _ in range(3):
        r = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
            max_tokens=4000, extra_body={"return_token_ids": True})
        prompt_ids = (r.model_extra or {})["prompt_token_ids"]
        assert prompt_ids[: len(prev)] == prev
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]  # type: ignore[index]
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "no results"})
        prev = prompt_ids + (choice.model_extra or {})["token_ids"]


async def test_metrics_parse_with_prometheus_parser(urls: list[str]) -> None:
    async with _client(urls[1]) as client:
        await client.completions.create(model=MODEL, prompt="a b c", max_tokens=5)
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{urls[1]}/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:time_to_first_token_seconds",
                 "vllm:request_time_per_output_token_seconds"):
        assert name in families, name
    gen = families["vllm:generation_tokens"].samples[0]
    assert gen.labels == {"model_name": MODEL} and gen.value == 5
    # vLLM >= 0.11's inter-token latency: 4 intervals after the first of 5 tokens, whose
    # sum is the request's decode time (its mean inter-token time, 4 times)
    itl = {s.name: s.value for s in families["vllm:inter_token_latency_seconds"].samples}
    tpot = {s.name: s.value
            for s in families["vllm:request_time_per_output_token_seconds"].samples}
    assert itl["vllm:inter_token_latency_seconds_count"] == 4
    assert itl["vllm:inter_token_latency_seconds_sum"] == pytest.approx(
        4 * tpot["vllm:request_time_per_output_token_seconds_sum"])
    assert tpot["vllm:request_time_per_output_token_seconds_sum"] > 0
    # which is the clock the gateway's speed meter reads
    assert parse_vllm_metrics(text).decode_clock == (
        pytest.approx(itl["vllm:inter_token_latency_seconds_sum"]), 4)


async def test_client_disconnect_mid_stream_aborts_upstream(urls: list[str]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 5000, "ignore_eos": True, "stream": True, "priority": 3}
    async with httpx.AsyncClient(base_url=urls[2]) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if '"token_ids"' in line or '"content":"' in line:
                    break
        for _ in range(100):
            stats = (await http.get("/sim/stats")).json()
            if stats["aborted"]:
                break
            await asyncio.sleep(0.02)
    assert stats["aborted"] == 1 and stats["running"] == 0 and stats["kv_usage"] == 0
    assert stats["requests_seen"][-1]["priority"] == 3


async def test_client_timeout_on_non_streaming_call_aborts_upstream(urls: list[str]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 5000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=urls[3]) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=body, timeout=0.3)
        for _ in range(100):
            stats = (await http.get("/sim/stats")).json()
            if stats["aborted"]:
                break
            await asyncio.sleep(0.02)
    assert stats["aborted"] == 1 and stats["running"] == 0


async def test_errors_use_the_openai_envelope(urls: list[str]) -> None:
    async with httpx.AsyncClient(base_url=urls[0]) as http:
        missing = await http.post("/v1/chat/completions", json={
            "model": "nope", "messages": [{"role": "user", "content": "x"}]})
        bad = await http.post("/v1/chat/completions", content=b"{not json")
        invalid = await http.post("/v1/completions", json={"model": MODEL, "prompt": 3})
    assert missing.status_code == 404
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert bad.status_code == 400 and "error" in bad.json()
    assert invalid.status_code == 400


async def test_ignore_eos_n_and_stop(urls: list[str]) -> None:
    async with _client(urls[1]) as client:
        await _ignore_eos_n_and_stop(client)


async def _ignore_eos_n_and_stop(client: AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, max_tokens=17,
        logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [len((c.model_extra or {})["token_ids"]) for c in r.choices] == [17, 17, 17]
    assert all(len(c.logprobs.content) == 17 for c in r.choices)  # type: ignore[union-attr]
    plain = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=17, seed=1,
        extra_body={"ignore_eos": True})
    text = plain.choices[0].message.content or ""
    word = text.split()[5]
    cut = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=17, seed=1,
        stop=[word], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.find(word)]


async def test_the_context_is_the_models_unless_given() -> None:
    """Qwen3's 40,960 by default (vLLM's max_model_len for it), Llama 3.1's 131,072; a
    given ``max_model_len`` (``sim-backend --max-model-len``, a pool's ``max_model_len``)
    wins, and the engine refuses what does not fit it, as vLLM does."""
    configs = [SimServerConfig(speed=50), SimServerConfig(speed=50, max_model_len=131072),
               SimServerConfig(model="llama3.1-8b", speed=50),
               SimServerConfig(speed=50, max_model_len=64)]
    async with start_sim_servers(configs) as found, httpx.AsyncClient(timeout=10) as http:
        lens = [(await http.get(f"{u}/v1/models")).json()["data"][0]["max_model_len"]
                for u in found]
        assert lens == [40960, 131072, 131072, 64]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 100}
        refused = await http.post(f"{found[3]}/v1/chat/completions", json=body)
        assert refused.status_code == 400 and "maximum context length is 64" in refused.text
        ok = await http.post(f"{found[1]}/v1/chat/completions",
                             json={**body, "max_tokens": 100_000})
        assert ok.status_code == 200, ok.text


async def test_detokenize_answers_as_vllm_does(urls: list[str]) -> None:
    """vLLM's ``POST /detokenize``: one string for the list (special tokens kept), 400 in
    OpenAI's envelope for an id past the vocabulary, 404 for another model."""
    async with httpx.AsyncClient(base_url=urls[0]) as http:
        ids = (await http.post("/tokenize", json={
            "model": MODEL, "messages": [{"role": "user", "content": "fix the bug"}]})
               ).json()["tokens"]
        whole = (await http.post("/detokenize", json={"model": MODEL, "tokens": ids})).json()
        pieces = [(await http.post("/detokenize", json={"tokens": [i]})).json()["prompt"]
                  for i in ids]
        bad = await http.post("/detokenize", json={"tokens": [2**31 - 1]})
        other = await http.post("/detokenize", json={"model": "nope", "tokens": ids})
    assert whole["prompt"].startswith("<|im_start|>user\nfix the bug<|im_end|>")
    assert "".join(pieces) == whole["prompt"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert other.status_code == 404
