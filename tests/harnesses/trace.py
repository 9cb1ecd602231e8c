"""What every harness test asserts: the gateway kept an exact token trace of the run."""

from __future__ import annotations

import itertools
from typing import Any

import httpx

from backends.sim.tokenizer import get_tokenizer


def assert_exact_trace(gw: str, traj: str, *, calls: int | None = None,
                       texts: list[str] | None = None) -> list[dict[str, Any]]:
    """Calls of ``traj`` in order, each ok with token ids and logprobs, stored as prefix
    deltas with no mismatch, rebuilt into one sample; ``texts`` (what the client saw as
    each turn's text, where known) must decode from the stored completion ids."""
    detail = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json()
    got = detail["calls"]
    if calls is not None:
        assert len(got) == calls, [c["seq"] for c in got]
    assert [c["seq"] for c in got] == list(range(len(got)))
    for c in got:
        assert c["status"] == "ok", c["error"]
        assert c["mismatch_pos"] is None
        assert len(c["completion_logprobs"]) == len(c["completion_ids"]) > 0
        assert all(lp <= 0 for lp in c["completion_logprobs"])
    for prev, cur in itertools.pairwise(got):
        assert cur["prompt_offset"] == prev["prompt_offset"] + len(prev["prompt_delta_ids"]) \
            + len(prev["completion_ids"])
    sample = httpx.get(f"{gw}/trajectories/{traj}/sample", timeout=10).json()
    assert len(sample["token_ids"]) == got[-1]["prompt_len"] + len(got[-1]["completion_ids"])
    assert sum(sample["loss_mask"]) == sum(len(c["completion_ids"]) for c in got)
    if texts is not None:
        tok = get_tokenizer()
        for c, text in zip(got, texts, strict=True):
            if text:
                assert text in tok.decode(c["completion_ids"])
    return got
