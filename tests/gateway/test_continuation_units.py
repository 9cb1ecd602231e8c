"""Pure parts of weight updates: what can be continued, segments, staleness."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import CaptureSettings
from gateway.live_calls import LiveCalls, continuable, engine_ids
from gateway.proxy.calls import weight_segments
from gateway.proxy.capture import Capture, inject
from gateway.proxy.continuation import HoldingDecoder
from gateway.store.samples import staleness
from gateway.weights.update import _plan


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
    live.add("d", "b2", {"model": "m", "stream": True}, seen.append)
    live.remove("b")
    assert live.blocking("b1") == 0 and len(live) == 3
    assert sorted(live.on("b2")) == ["c", "d"] and live.on("b2")["d"].frozen
    live.mark_aborted(["c", "d"])
    assert [live.aborted(c) for c in "acdx"] == [False, True, True, False]
    assert not live.on("b2")["d"].frozen  # aborted: continued, not frozen
    live.answered("c")
    assert live.on("b2")["c"].answered and not live.on("b2")["d"].answered
    live.continued("c")
    assert not live.aborted("c") and live.aborted("d") and not live.on("b2")["c"].answered
    assert engine_ids("x1")[:2] == ["chatcmpl-x1", "cmpl-x1-0"]  # as vLLM names them


@pytest.mark.parametrize(("mode", "expected"), [
    ("wait", ("wait", [])),
    ("abort-and-continue", ("abort", ["whole", "stream", "tools"])),  # no frozen stream
    ("keep", ("keep", ["whole", "tools"])),  # streams stay frozen, the rest aborted
])
def test_each_engine_gets_the_pause_its_calls_need(
        mode: str, expected: tuple[str, list[str]]) -> None:
    live = LiveCalls()
    live.add("whole", "b", {"model": "m"})
    live.add("stream", "b", {"model": "m", "stream": True})
    live.add("tools", "b", {"model": "m", "tools": [{"type": "function"}]})
    assert _plan(live.on("b"), mode) == expected  # type: ignore[arg-type]
    live.add("frozen", "b", {"model": "m", "stream": True, "tools": [{}]})
    if mode == "abort-and-continue":  # a stream that cannot be continued: keep, and
        # abort the others one by one
        assert _plan(live.on("b"), mode) == ("keep", ["whole", "stream", "tools"])


@pytest.mark.parametrize(("mode", "expected"), [
    ("wait", ("wait", [])),
    ("abort-and-continue", ("wait", ["whole", "stream", "tools"])),
    ("keep", ("wait", ["whole", "tools"])),
])
def test_an_engine_that_groups_tokens_never_freezes_a_stream(
        mode: str, expected: tuple[str, list[str]]) -> None:
    """vLLM started with ``--stream-interval N`` holds up to N-1 tokens it made unsent
    across a pause: a frozen stream's boundary would not be exact (the real-vLLM truth
    test found 2 of 2800 tokens stamped with the wrong weights at N = 8). Such an engine
    finishes the streams ``keep`` would freeze, the other calls aborted first; with
    nothing to freeze, it is paused as before."""
    live = LiveCalls()
    live.add("whole", "b", {"model": "m"})
    live.add("stream", "b", {"model": "m", "stream": True})
    live.add("tools", "b", {"model": "m", "tools": [{"type": "function"}]})
    if mode == "abort-and-continue":
        assert _plan(live.on("b"), mode, grouped=True) == (
            "abort", ["whole", "stream", "tools"])
        live.add("frozen", "b", {"model": "m", "stream": True, "tools": [{}]})
    assert _plan(live.on("b"), mode, grouped=True) == expected  # type: ignore[arg-type]
    if mode == "keep":  # no stream yet: still wait, a stream placed late is not frozen
        only = LiveCalls()
        only.add("whole", "b", {"model": "m"})
        assert _plan(only.on("b"), "keep", grouped=True) == ("wait", ["whole"])


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


# What vLLM 0.32 streams for a request it aborts (``/pause?mode=abort``) before the
# request's first token, e.g. while it waits in the engine's queue (measured on the CPU
# build; docs/weight-updates.md): no chunk with tokens and no finish_reason at all.
_ROLE = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
         b'"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
         b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,300,201]}\n\n')
_USAGE = (b'data: {"id":"x","object":"text_completion","created":1,"model":"tiny",'
          b'"choices":[],"usage":{"prompt_tokens":5,"total_tokens":5,'
          b'"completion_tokens":0}}\n\n')
_DONE = b"data: [DONE]\n\n"


def _decoder(chat: bool, aborted: bool, fast: bool = True) -> tuple[HoldingDecoder, Capture]:
    body: dict[str, Any] = {"model": "tiny", "stream": True, "max_tokens": 10}
    capture = Capture(chat=chat, asked=inject(body, chat=chat))
    ctx = SimpleNamespace(capture=capture, body=body, lease=object(), id="c1",
                          endpoint="chat" if chat else "completions")
    live = LiveCalls()
    live.add("c1", "b1", body)
    if aborted:  # its engine was told to abort for abort-and-continue
        live.mark_aborted(["c1"])
    rt = SimpleNamespace(live_calls=live,
                         settings=SimpleNamespace(capture=CaptureSettings(fast_relay=fast)))
    return HoldingDecoder(rt, ctx), capture  # type: ignore[arg-type]


@pytest.mark.parametrize(("chat", "events"), [
    (False, [_DONE]),  # /v1/completions: nothing but [DONE]
    (False, [_USAGE, _DONE]),  # ... with stream_options.include_usage
    (True, [_ROLE, _DONE]),  # chat: the role chunk (sent with the abort), [DONE]
    (True, [_ROLE, _USAGE, _DONE]),
])
def test_a_stream_aborted_before_its_first_token_is_held(
        chat: bool, events: list[bytes]) -> None:
    decoder, capture = _decoder(chat, aborted=True)
    out = b"".join(decoder.feed(e) for e in events) + decoder.flush()
    assert decoder.held and capture.completion(0).finish_reason == "abort"
    assert out.count(b"data: ") == (1 if chat else 0)  # only the role chunk passes
    assert b"[DONE]" not in out and b"usage" not in out


def test_a_bare_done_of_a_call_no_pause_aborted_passes() -> None:
    decoder, capture = _decoder(False, aborted=False)
    assert decoder.feed(_DONE) == _DONE
    assert not decoder.held and capture.completion(0).finish_reason is None
