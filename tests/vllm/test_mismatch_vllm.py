"""The training-inference mismatch check on real vLLM (issue 43, items 3-4).

A tool agent (a forced tool call, the tool's answer, two free turns) runs through the
gateway on the real CPU engine (bf16); the trainer is the same checkpoint in float32
(transformers), scoring each main sample with :func:`trainer_logprobs`. On the free turns
the clean batch stays inside every limit. The forced call is sampled from a distribution
the engine masked to valid JSON, so its recorded logprobs are those of another
distribution: the gateway marks the call (``CallSpan.constrained``) and the report shows
its tokens apart (a real mismatch a TIS correction must see, not held against the limits).
Planted defects in what reaches the trainer must raise the alarm or move the figures
far: loss mask 1 on the tool's answer and prompts, and logprobs shifted by one token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.base import LaunchedInstance
from gateway.app import create_app
from gateway.client.mismatch import measure_mismatch, trainer_logprobs
from gateway.client.types import sample_from_json
from gateway.config import Settings, TraceSettings
from gateway.schema.samples import Sample
from tests.servers import free_port, serve_app, stop_app
from tests.vllm.conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "look a key up",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}}]


async def _agent(c: httpx.AsyncClient, traj: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is stored at k7?"}]
    for turn in range(3):
        body = {"model": SERVED_NAME, "messages": messages, "tools": TOOLS, "max_tokens": 24,
                "temperature": 1.0, "tool_choice": "required" if turn == 0 else "none"}
        r = await c.post(f"/t/{traj}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        messages.append({"role": "assistant", "content": msg.get("content"),
                         **({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {})})
        for call in msg.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "k7 = 41"})
        if not msg.get("tool_calls"):
            messages.append({"role": "user", "content": "Are you sure?"})


def _with(s: Sample, **fields: Any) -> Sample:
    return Sample(**{**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)}, **fields})


async def test_mismatch_is_small_when_clean_and_alarms_on_defects_on_real_vllm(
        tp1_server: LaunchedInstance, tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'mm.db'}",
                        backends=[tp1_server.url], traces=TraceSettings(flush_interval_s=0.05))
    port = free_port()
    server, task = await serve_app(create_app(settings), port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            trajs = [f"real-mm-{i}" for i in range(4)]
            for traj in trajs:
                await _agent(c, traj)
            samples = [sample_from_json((await c.get(f"/trajectories/{t}/sample")).json())
                       for t in trajs]
    finally:
        await stop_app(server, task)
    assert all(len(s.calls) == 3 for s in samples)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    logps = trainer_logprobs(model.eval(), samples)
    clean = measure_mismatch(samples, logps)
    shifted = measure_mismatch([_with(s, logprobs=[*s.logprobs[1:], 0.0]) for s in samples],
                               logps)
    tool_mask = measure_mismatch([_with(s, loss_mask=[1] * len(s.token_ids)) for s in samples],
                                 logps)
    for name, r in (("clean", clean), ("shifted by one", shifted),
                    ("mask 1 on tool output", tool_mask)):
        for part, o in (("free", r.overall), ("constrained", r.constrained)):
            assert o is not None
            print(f"{name}, {part}: {o.tokens} tokens, |d| {o.mean_abs_diff:.4f}, KL "
                  f"{o.kl:.2e}, ratio p1 {o.ratio_percentiles['p1']:.3f} p99 "
                  f"{o.ratio_percentiles['p99']:.3f}, outside {o.outside_share:.1%}")
        print(f"{name}: alarms {r.alarms}")

    # the gateway marked the forced call: its tokens are reported apart
    assert all([c.constrained for c in s.calls] == ["tool_choice", None, None]
               for s in samples)
    forced = sum(s.calls[0].completion_end - s.calls[0].completion_start for s in samples)
    assert clean.constrained is not None and clean.constrained.tokens == forced
    assert clean.constrained.ratio_percentiles["p1"] < 0.5  # masked logprobs: a real gap
    # bf16 engine against a float32 trainer on the same weights: inside every limit
    assert clean.alarms == [], clean.overall
    assert clean.overall is not None and clean.skipped_tokens == 0
    assert clean.overall.tokens + forced == sum(sum(s.loss_mask) for s in samples)
    assert list(clean.by_version) == ["0"]
    # the defects: the tool's answer and the prompts were never sampled (logprob 0)
    assert tool_mask.alarms and tool_mask.by_version["?"].outside_share > 0.9
    assert shifted.alarms, shifted.overall
    assert shifted.overall is not None
    assert shifted.overall.mean_abs_diff > 50 * clean.overall.mean_abs_diff, shifted.overall
