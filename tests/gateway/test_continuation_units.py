"""Pure parts of weight updates: what can be continued, segments, staleness."""

from __future__ import annotations

import pytest

from gateway.proxy.calls import weight_segments
from gateway.proxy.live import LiveCalls, continuable
from gateway.store.samples import staleness


@pytest.mark.parametrize(("extra", "ok"), [
    ({}, True),
    ({"tools": [{"type": "function"}]}, False),
    ({"tools": [{"type": "function"}], "tool_choice": "none"}, True),
    ({"response_format": {"type": "json_object"}}, False),
    ({"response_format": {"type": "text"}}, True),
    ({"guided_json": {"type": "object"}}, False),
    ({"n": 2}, False),
    ({"echo": True}, False),
    ({"logprobs": True, "top_logprobs": 3, "stop": ["\n"]}, True),
])
def test_continuable(extra: dict[str, object], ok: bool) -> None:
    assert continuable({"model": "m", **extra}) is ok


def test_live_calls_count_what_blocks_an_abort() -> None:
    live = LiveCalls()
    live.add("a", "b1", {"model": "m"})
    live.add("b", "b1", {"model": "m", "n": 3})
    live.add("c", "b2", {"model": "m"})
    assert (live.blocking("b1"), live.blocking("b2")) == (1, 0)
    seen: list[str] = []
    live.add("d", "b2", {"model": "m"}, seen.append)
    live.new_version("7")
    live.remove("b")
    assert seen == ["7"] and live.blocking("b1") == 0 and len(live) == 3


def test_weight_segments() -> None:
    assert weight_segments("0", [], 10) is None
    assert weight_segments("0", [(4, "1")], 10) == [[0, 4, "0"], [4, 10, "1"]]
    assert weight_segments("0", [(4, "1"), (7, "2")], 10) == [
        [0, 4, "0"], [4, 7, "1"], [7, 10, "2"]]
    assert weight_segments("0", [(4, "0")], 10) is None  # same version: one segment
    assert weight_segments("0", [(0, "1")], 5) == [[0, 5, "1"]]  # aborted before a token


def test_staleness() -> None:
    assert staleness(["", "3", "5"], None) == 2
    assert staleness(["", "3", "5"], "7") == 4
    assert staleness(["", "v1"], "v2") is None
    assert staleness([""], "2") is None
