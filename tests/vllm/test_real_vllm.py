"""A real vLLM (CPU build, tiny model) through LocalVLLMLauncher: start, serve, crash, stop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from backends.base import InstanceSpec, LaunchedInstance
from backends.vllm_local import group_members
from tests.vllm.conftest import SERVED_NAME, cpu_launcher

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

CAPTURE = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_server_is_ready_and_serves_models(tp1_server: LaunchedInstance) -> None:
    async with httpx.AsyncClient(base_url=tp1_server.url, timeout=30) as client:
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    assert tp1_server.log_path is not None
    assert Path(tp1_server.log_path).exists()


async def test_non_streaming_call_returns_token_ids(tp1_server: LaunchedInstance) -> None:
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 8, **CAPTURE}
    async with httpx.AsyncClient(base_url=tp1_server.url, timeout=60) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    resp.raise_for_status()
    data = resp.json()
    choice = data["choices"][0]
    assert len(data["prompt_token_ids"]) == data["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == data["usage"]["completion_tokens"] > 0
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


async def test_streaming_call_returns_token_ids(tp1_server: LaunchedInstance) -> None:
    body = {
        "model": SERVED_NAME,
        "messages": MESSAGES,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        **CAPTURE,
    }
    prompt_ids: list[int] = []
    completion_ids: list[int] = []
    usage: dict[str, int] = {}
    async with (
        httpx.AsyncClient(base_url=tp1_server.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            prompt_ids += chunk.get("prompt_token_ids") or []
            for choice in chunk["choices"]:
                completion_ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    assert len(prompt_ids) == usage["prompt_tokens"]
    assert len(completion_ids) == usage["completion_tokens"] > 0


async def test_crash_is_detected_and_stop_reaps_orphans(
    vllm_python: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    launcher = cpu_launcher(vllm_python, tiny_model_dir, tmp_path)
    instance = await launcher.start(InstanceSpec(id="victim", model=SERVED_NAME, gpus=(1,)))
    pid = int(instance.meta["pid"])
    assert await launcher.alive(instance)
    assert len(group_members(pid)) > 1  # the API server and its engine core

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while await launcher.alive(instance):
        assert time.monotonic() < deadline, "alive() still true 10 s after kill -9"
        await asyncio.sleep(0.1)

    await launcher.stop(instance, grace_s=5)
    assert group_members(pid) == []
    await launcher.stop(instance)  # idempotent
    await launcher.close()


async def test_tp2_starts_serves_and_stops_cleanly(
    vllm_python: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    launcher = cpu_launcher(vllm_python, tiny_model_dir, tmp_path)
    started = time.monotonic()
    instance = await launcher.start(InstanceSpec(id="tp2", model=SERVED_NAME, tp=2, gpus=(0, 1)))
    ready_s = time.monotonic() - started
    body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, "logprobs": 0,
            "return_token_ids": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=instance.url, timeout=120) as client:
        resp = await client.post("/v1/completions", json=body)
    resp.raise_for_status()
    assert len(resp.json()["choices"][0]["token_ids"]) == 4
    pid = int(instance.meta["pid"])
    await launcher.stop(instance)
    assert not await launcher.alive(instance)
    assert group_members(pid) == []
    print(f"TP2 ready in {ready_s:.1f} s")


async def test_the_relays_fast_path_takes_this_vllms_token_events(
        tp1_server: LaunchedInstance) -> None:
    """The installed vLLM's stream, as the gateway asks for it, takes the relay's fast path
    (gateway/proxy/token_runs.py) and gives the same capture and relayed JSON as the
    general path, whatever the client asked for."""
    from gateway.proxy.capture import Capture, inject
    from tests.gateway.test_token_runs import cut, run

    for asked_lp in (False, True):
        body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 24,
                "ignore_eos": True, "stream": True, "logprobs": asked_lp}
        asked = inject(body, chat=True)
        async with (
            httpx.AsyncClient(base_url=tp1_server.url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as resp,
        ):
            resp.raise_for_status()
            data = await resp.aread()
        for sizes in ([], [211], [1]):
            fast, fast_out = run(cut(data, sizes), asked, fast=True)
            slow, slow_out = run(cut(data, sizes), asked, fast=False)
            assert fast_out == slow_out and fast.choices == slow.choices
            assert isinstance(fast, Capture) and len(fast.completion(0).token_ids) == 24
            assert fast.fast >= 20, (fast.fast, data[:600])
