"""A gateway over two simulated vLLM servers, for the client and the example scripts.

Also the check every trajectory recorded here must pass: the token trace is exact
(no mismatch, prefix deltas chain up, completion ids and logprobs aligned) and the
training sample is the concatenation of what was recorded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from tests.gateway.conftest import make_settings
from tests.servers import LoopThread, app_in_thread, two_sim_servers

MODEL = "qwen3-14b"
ADMIN_TOKEN = "admin-secret"
GatewayFactory = Callable[..., AbstractContextManager[str]]


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="module")
def sim_urls(loop_thread: LoopThread) -> Iterator[list[str]]:
    """Two simulated vLLM servers, 50x faster than real time, short answers."""
    yield from two_sim_servers(loop_thread)


@pytest.fixture
def gateway(loop_thread: LoopThread, sim_urls: list[str]) -> GatewayFactory:
    """``gateway(db_url, **settings)``: a context manager serving the gateway; yields its URL."""

    def start(db_url: str, *, backends: list[str] | None = None,
              **kw: Any) -> AbstractContextManager[str]:
        settings = make_settings(db_url, sim_urls if backends is None else backends, **kw)
        return app_in_thread(loop_thread, lambda: create_app(settings))

    return start


def check_trace(gw: str, trajectory_id: str, *, min_calls: int = 1) -> dict[str, Any]:
    """Assert the stored trace of one trajectory is token-exact; returns its detail."""
    detail: dict[str, Any] = httpx.get(f"{gw}/trajectories/{trajectory_id}", timeout=30).json()
    calls = detail["calls"]
    assert len(calls) >= min_calls, detail
    assert [c["seq"] for c in calls] == list(range(len(calls)))
    for c in calls:
        assert c["status"] == "ok", c
        assert c["mismatch_pos"] is None, f"re-tokenization drift at call {c['seq']}"
        assert len(c["completion_ids"]) == len(c["completion_logprobs"]) > 0
        assert all(lp <= 0 for lp in c["completion_logprobs"])
        assert c["prompt_len"] == c["prompt_offset"] + len(c["prompt_delta_ids"])
    for prev, cur in itertools.pairwise(calls):
        assert cur["prompt_offset"] == prev["prompt_len"] + len(prev["completion_ids"])
    sample = httpx.get(f"{gw}/trajectories/{trajectory_id}/sample", timeout=30).json()
    assert sample["mismatches"] == []
    expected = [t for c in calls for t in c["prompt_delta_ids"] + c["completion_ids"]]
    assert sample["token_ids"] == expected
    assert sample["loss_mask"] == [m for c in calls for m in
                                   [0] * len(c["prompt_delta_ids"]) + [1] * len(c["completion_ids"])]
    masked = [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True) if m]
    assert masked == pytest.approx([lp for c in calls for lp in c["completion_logprobs"]])
    return detail
