"""A mixture-of-experts policy on a real vLLM (CPU build): everything but routes.

The tiny model as a Qwen3-MoE (2 layers of 8 experts, top 2, its router's weights drawn
wide so tokens pick different experts) served by vLLM 0.32 on the CPU, behind a gateway.
vLLM's CPU build refuses ``--enable-return-routed-experts`` ("AuxOutput Connector
requires Model Runner V2"), so the engine returns no routes: a trajectory of a plain and a
streamed turn is recorded whole, the gateway asks the engine for a stream's routes once,
learns it returns none and says so, and the sample's tokens and logprobs are those of an
independent forward of the same MoE in transformers (float32, CPU), while the same
logprobs read one position off are not. Routes themselves are checked with the simulated
engine (tests/gateway/test_routes_capture.py) and a real MoE forward
(tests/client/test_routing_replay.py).
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.vllm.conftest import REPO_ROOT, own_engine_gateway
from tests.vllm.truth import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


@pytest.fixture(scope="module")
def moe_dir(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-moe"
    subprocess.run([vllm_python, "-m", "backends.tinymodel", "--moe", str(out)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=180)
    return out


async def _turns(http: httpx.AsyncClient, tid: str) -> None:
    headers = {"x-trajectory-id": tid}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    body = {"model": SERVED_NAME, "max_tokens": 24, "ignore_eos": True, "temperature": 1.0}
    r = await http.post("/v1/chat/completions", headers=headers,
                        json={**body, "messages": messages})
    assert r.status_code == 200, r.text
    messages += [r.json()["choices"][0]["message"],
                 {"role": "user", "content": "and now read the first one"}]
    text = []
    async with http.stream("POST", "/v1/chat/completions", headers=headers,
                           json={**body, "messages": messages, "stream": True}) as s:
        assert s.status_code == 200
        async for line in s.aiter_lines():
            if line.startswith("data: {"):
                assert "routed_experts" not in line
                text.append(line)
    assert text


def _reference_logprobs(model_dir: Path, ids: list[int]) -> np.ndarray:
    """``log p(ids[i] | ids[:i])`` for every ``i >= 1`` under transformers' own forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return np.asarray(picked.numpy(), dtype=np.float64)


async def test_a_moe_policy_is_recorded_exactly_and_its_engine_known_to_return_no_routes(
        vllm_python: str, moe_dir: Path, tmp_path: Path) -> None:
    tid = f"moe-{uuid.uuid4().hex[:8]}"
    async with own_engine_gateway(vllm_python, moe_dir, tmp_path, "moe") as gw, \
            httpx.AsyncClient(base_url=gw, timeout=120,
                              headers={"authorization": "Bearer tok"}) as http:
        await _turns(http, tid)
        r = await http.post(f"/trajectories/{tid}/finish", json={"reward": 1.0})
        assert r.status_code == 200, r.text
        sample = (await http.get(f"/trajectories/{tid}/sample")).json()
        status = (await http.get("/status")).json()

    assert [b["returns_routes"] for b in status["backends"]] == [False]  # probed once
    assert sample["routed_experts"] is None
    ids, mask = sample["token_ids"], sample["loss_mask"]
    generated = [i for i, m in enumerate(mask) if m]
    assert len(generated) == 48 and len(sample["calls"]) == 2  # every generated token trains
    recorded = np.array([sample["logprobs"][i] for i in generated])
    reference = _reference_logprobs(moe_dir, ids)
    here = np.abs(recorded - reference[np.array(generated) - 1])
    # vLLM's bfloat16 MoE against a float32 forward of the same weights: a few thousandths
    assert here.mean() < 0.01 and here.max() < 0.05, (here.mean(), here.max())
    off = np.abs(recorded - reference[np.array(generated) - 2])  # read one position off
    assert off.mean() > 10 * here.mean()
