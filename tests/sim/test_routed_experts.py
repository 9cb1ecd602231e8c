"""Routed experts on the simulated server, in vLLM 0.32's wire format
(``--enable-return-routed-experts``; ``backends.sim.routes``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest

from backends.sim.routes import MOE_SHAPES, MoeShape, decode, routed_experts
from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig

MODEL = "qwen3-14b"
ROUTER = MOE_SHAPES["qwen3-30b-a3b"]


@pytest.fixture
async def urls() -> AsyncIterator[list[str]]:
    """One server with routes on (Qwen3-30B-A3B's router), one without."""
    async with start_sim_servers([SimServerConfig(enable_return_routed_experts=True,
                                                  moe=ROUTER),
                                  SimServerConfig(seed=1)]) as found:
        yield found


def test_routes_have_vllms_shape_dtype_and_distinct_experts() -> None:
    toks = list(range(100, 140))
    r = routed_experts(toks, 0, ROUTER)
    assert r.shape == (39, 48, 8) and r.dtype == np.uint8  # the last token: no route
    assert all(len(set(row)) == 8 for row in r.reshape(-1, 8).tolist())
    assert int(r.max()) < 128
    big = MoeShape(4, 300, 6)
    assert routed_experts(toks, 0, big).dtype == np.uint16  # over 256 experts
    # the same context under the same weights routes the same way; a later start is a
    # suffix; other weights route otherwise
    assert np.array_equal(routed_experts(toks, 10, ROUTER), r[10:])
    assert np.array_equal(routed_experts([*toks, 7, 8], 0, ROUTER)[:39], r)
    assert not np.array_equal(routed_experts(toks, 0, ROUTER, salt="v2|"), r)
    assert routed_experts(toks, 39, ROUTER).shape == (0, 48, 8)


async def test_answers_carry_routes_of_the_positions_asked_for(urls: list[str]) -> None:
    body = {"model": MODEL, "max_tokens": 12, "ignore_eos": True, "seed": 4,
            "return_token_ids": True, "messages": [{"role": "user", "content": "hi there"}]}
    async with httpx.AsyncClient(base_url=urls[0], timeout=30) as http:
        whole = (await http.post("/v1/chat/completions", json=body)).json()
        prompt, out = whole["prompt_token_ids"], whole["choices"][0]["token_ids"]
        routes = decode(whole["choices"][0]["routed_experts"])
        assert routes.shape == (len(prompt) + len(out) - 1, 48, 8)
        assert np.array_equal(routes, routed_experts(prompt + out, 0, ROUTER, "default|"))

        later = (await http.post("/v1/chat/completions", json={
            **body, "routed_experts_prompt_start": len(prompt)})).json()
        tail = decode(later["choices"][0]["routed_experts"])
        assert np.array_equal(tail, routes[len(prompt):])  # only the new positions

        # the next turn, token in: its prompt is the whole first turn; asking from where
        # the record ends gives the routes of the positions the record lacks, and the
        # overlap agrees with what the first turn returned
        turn2 = {"model": MODEL, "prompt": prompt + out, "max_tokens": 5,
                 "ignore_eos": True, "return_token_ids": True,
                 "routed_experts_prompt_start": len(prompt) + len(out) - 1}
        second = (await http.post("/v1/completions", json=turn2)).json()
        more = decode(second["choices"][0]["routed_experts"])
        full = routed_experts(prompt + out + second["choices"][0]["token_ids"], 0, ROUTER,
                              "default|")
        assert np.array_equal(np.concatenate([routes, more]), full)

        r = await http.post("/v1/chat/completions",
                            json={**body, "routed_experts_prompt_start": len(prompt) + 1})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            f"routed_experts_prompt_start must be between 0 and the prompt length "
            f"({len(prompt)}), inclusive.")
        r = await http.post("/v1/chat/completions",
                            json={**body, "routed_experts_prompt_start": -1})
        assert r.status_code == 400

        async with http.stream("POST", "/v1/chat/completions",
                               json={**body, "stream": True}) as s:  # streams carry none
            assert "routed_experts" not in (await s.aread()).decode()
    async with httpx.AsyncClient(base_url=urls[1], timeout=30) as http:  # routes off
        plain = (await http.post("/v1/chat/completions", json=body)).json()
        assert "routed_experts" not in plain["choices"][0]


def test_routes_need_a_router() -> None:
    with pytest.raises(ValueError, match="mixture-of-experts"):
        SimServerConfig(enable_return_routed_experts=True).router()
    assert SimServerConfig(model="tiny-moe", enable_return_routed_experts=True).router() \
        == MoeShape(2, 8, 2)
