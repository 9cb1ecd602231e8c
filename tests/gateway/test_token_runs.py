"""The relay's fast path captures and relays exactly what the general path does.

Each stream is fed, cut the same way, to a decoder with the fast path and to one without
(every event parsed on its own, as before the fast path existed); the captured ids,
logprobs, text, finish and usage, and the relayed events (as JSON), must be equal. The
streams are vLLM's (the bytes of docs/real-vllm-wire-format.md), the simulated server's,
the benchmark upstream's, and ones built to trip a byte-level shortcut.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from bench.harness.fast_upstream import FastUpstream
from gateway.proxy.capture import Capture, ClientAsked
from gateway.proxy.sse import SSEDecoder

# vLLM 0.32 on CPU, a chat call streamed with logprobs and return_token_ids
# (docs/real-vllm-wire-format.md)
VLLM = (
    b'data: {"id":"chatcmpl-a1750c049332a1d9","object":"chat.completion.chunk","created":'
    b'1795274278,"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant","content"'
    b':""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,300,201,74,75,2,201,'
    b'1,310,201],"prompt_text":null}\n\n'
    b'data: {"id":"chatcmpl-a1750c049332a1d9","object":"chat.completion.chunk","created":'
    b'1795274278,"model":"tiny","choices":[{"index":0,"delta":{"content":"close"},"logprobs"'
    b':{"content":[{"token":"close","logprob":-6.104329586029053,"bytes":[99,108,111,115,101]'
    b',"top_logprobs":[]}]},"finish_reason":null,"token_ids":[638]}]}\n\n'
    b'data: {"id":"chatcmpl-a1750c049332a1d9","object":"chat.completion.chunk","created":'
    b'1795274278,"model":"tiny","choices":[{"index":0,"delta":{"content":" 32"},"logprobs":'
    b'{"content":[{"token":" 32","logprob":-7.1656622886657715,"bytes":[32,51,50],'
    b'"top_logprobs":[]}]},"finish_reason":null,"token_ids":[654]}]}\n\n'
    b'data: {"id":"chatcmpl-a1750c049332a1d9","object":"chat.completion.chunk","created":'
    b'1795274278,"model":"tiny","choices":[{"index":0,"delta":{"content":" 2"},"logprobs":'
    b'{"content":[{"token":" 2","logprob":-6.990982532501221,"bytes":[32,50],"top_logprobs"'
    b':[]}]},"finish_reason":"length","stop_reason":null,"token_ids":[350]}],'
    b'"system_fingerprint":"vllm-0.32.0-87d1973d"}\n\n'
    b'data: {"id":"chatcmpl-b01baaf973998dd9","object":"chat.completion.chunk","created":'
    b'1795274278,"model":"tiny","choices":[],"usage":{"prompt_tokens":10,"total_tokens":12,'
    b'"completion_tokens":2},"system_fingerprint":"vllm-0.32.0-87d1973d"}\n\n'
    b'data: [DONE]\n\n')

ASKED = [ClientAsked(token_ids=i, logprobs=lp) for i in (False, True) for lp in (False, True)]


def token_event(text: str, tid: int, lp: float = -0.5, *, top: list[Any] | None = None,
                **extra: Any) -> bytes:
    """One plain token event as vLLM writes it (``extra`` adds keys to the choice)."""
    entry = {"token": text, "logprob": lp, "bytes": list(text.encode()),
             "top_logprobs": top or []}
    choice = {"index": 0, "delta": {"content": text}, "logprobs": {"content": [entry]},
              "finish_reason": None, "token_ids": [tid], **extra}
    event = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1,
             "model": "tiny", "choices": [choice]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def stream(texts: list[str]) -> bytes:
    """vLLM's role chunk, a token event per text, the finish, usage and [DONE]."""
    head = VLLM.split(b"\n\n")[0]
    return (head + b"\n\n" + b"".join(token_event(t, 100 + i) for i, t in enumerate(texts))
            + VLLM.split(b"\n\n", 3)[3])


def cut(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` in reads of the given sizes (cycled), the last read what is left."""
    out, i, k = [], 0, 0
    while i < len(data):
        n = max(1, sizes[k % len(sizes)]) if sizes else len(data)
        out.append(data[i:i + n])
        i, k = i + n, k + 1
    return out


def run(reads: list[bytes], asked: ClientAsked, *, fast: bool) -> tuple[Capture, list[Any]]:
    capture = Capture(chat=True, asked=asked)
    decoder = SSEDecoder(capture, fast=fast)
    out = b"".join(decoder.feed(r) for r in reads) + decoder.flush()
    return capture, [_json(e) for e in out.split(b"\n\n") if e]


def _json(event: bytes) -> Any:
    """An event's JSON, or its bytes where it holds none."""
    try:
        return orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return event


def same(reads: list[bytes], asked: ClientAsked) -> Capture:
    """Both paths on ``reads``: equal capture and relayed JSON; the fast capture."""
    fast, fast_out = run(reads, asked, fast=True)
    slow, slow_out = run(reads, asked, fast=False)
    assert fast_out == slow_out
    assert fast.prompt_ids == slow.prompt_ids and fast.usage == slow.usage
    assert fast.choices == slow.choices
    assert fast.chunks == slow.chunks and slow.fast == 0
    return fast


@pytest.mark.parametrize("asked", ASKED)
@pytest.mark.parametrize("sizes", [[], [1], [7, 300, 2], [10_000]])
def test_vllm_stream_captured_and_relayed_alike(asked: ClientAsked, sizes: list[int]) -> None:
    cap = same(cut(VLLM, sizes), asked)
    assert cap.completion(0).token_ids == [638, 654, 350]
    assert cap.completion(0).logprobs[0] == -6.104329586029053
    data = stream([f" w{i}" for i in range(40)])
    cap = same(cut(data, sizes), asked)
    assert len(cap.completion(0).token_ids) == 41
    if sizes != [1]:  # byte by byte, each read completes at most one event: still fast
        assert cap.fast >= 30


def test_stripped_fields_are_gone_and_asked_ones_kept() -> None:
    data = stream(["a", "b", "c"])
    _, out = run([data], ASKED[0], fast=True)
    plain = [e for e in out if isinstance(e, dict) and e["choices"]][1:-1]
    assert len(plain) == 3
    assert all(e["choices"][0]["logprobs"] is None and "token_ids" not in e["choices"][0]
               for e in plain)
    _, out = run([data], ASKED[3], fast=True)
    plain = [e for e in out if isinstance(e, dict) and e["choices"]][1:-1]
    assert [e["choices"][0]["token_ids"] for e in plain] == [[100], [101], [102]]
    assert plain[0]["choices"][0]["logprobs"]["content"][0]["bytes"] == [97]


# text a byte-level shortcut would trip on: quotes, the event separator and the join
# marker inside the content, escapes, non-ASCII
_TRICKY = ['"},{"id":"x', "\n\ndata: {", '\\"', "\u00e9\u4e2d\U0001f600", "\x00\x1f", ""]


@pytest.mark.parametrize("asked", ASKED)
def test_a_token_that_ends_no_character(asked: ClientAsked) -> None:
    # vLLM sends an empty delta for a token that is part of a multi-byte character
    empty = token_event("", 9).replace(b'"delta":{"content":""}', b'"delta":{}')
    data = (VLLM.split(b"\n\n", 1)[0] + b"\n\n" + empty * 3 + token_event("a", 100)
            + VLLM.split(b"\n\n", 3)[3])
    cap = same([data], asked)
    assert cap.fast == 4 and cap.completion(0).token_ids[:4] == [9, 9, 9, 100]


@pytest.mark.parametrize("asked", ASKED)
def test_tricky_text(asked: ClientAsked) -> None:
    data = stream(_TRICKY)
    cap = same([data], asked)
    assert "".join(cap.completion(0).text) == "".join(_TRICKY) + " 2"
    assert cap.fast == len(_TRICKY)


@pytest.mark.parametrize("odd", [
    token_event("x", 1, stop_reason=None),  # a key vLLM sends only at the end
    token_event("x", 1, kv_transfer_params={"a": 1}),  # a key the fast path does not know
    token_event("x", 1, top=[{"token": "x", "logprob": -0.5, "bytes": [120]},
                             {"token": "y", "logprob": -2.0}]),  # top logprobs
    token_event("x", 1).replace(b'"index":0', b'"index":1'),  # a second choice
    token_event("x", 1).replace(b'"token_ids":[1]', b'"token_ids":[1,2]'),  # ids != lps
    token_event("x", 1).replace(b',"token_ids":[1]', b""),  # no ids returned
    token_event("x", 1).replace(b'"created":1', b'"created":1.5'),
    token_event("x", 1).replace(b'{"content":"x"}', b'{"content":null}'),
    token_event("x", 1).replace(b'{"content":"x"}', b'{"reasoning_content":"x"}'),
    token_event("x", 1).replace(b'"logprob":-0.5', b'"logprob":-1e-05'),
    # vLLM's keys in another order: taken, and relayed in vLLM's order
    b'data: {"choices":[{"token_ids":[1],"finish_reason":null,"delta":{"content":"x"},'
    b'"index":0,"logprobs":{"content":[{"top_logprobs":[],"logprob":-0.5,"token":"x"}]}}],'
    b'"model":"tiny","created":1,"object":"chat.completion.chunk","id":"c"}\n\n',
    b": a comment line\n\n",
    b"data: {not json}\n\n",
])
@pytest.mark.parametrize("asked", ASKED)
def test_odd_events_between_plain_ones(odd: bytes, asked: ClientAsked) -> None:
    plain = token_event("p", 7) * 3
    # the odd event first in the stream's body, in the middle of a run, and last
    data = (VLLM.split(b"\n\n", 1)[0] + b"\n\n" + odd + plain + odd + plain + odd
            + VLLM.split(b"\n\n", 3)[3])
    for sizes in ([], [len(plain) + len(odd) // 2], [1]):
        cap = same(cut(data, sizes), asked)
        if b"not json" not in odd:  # (a run with an event that is not JSON goes whole)
            assert cap.fast >= 6  # the odd event takes the general path, and no other


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(max_size=6), max_size=12),
       sizes=st.lists(st.integers(1, 900), max_size=6),
       asked=st.sampled_from(ASKED))
def test_any_text_any_reads(texts: list[str], sizes: list[int], asked: ClientAsked) -> None:
    data = stream(texts)
    cap = same(cut(data, sizes), asked)
    assert cap.completion(0).text[1:len(texts) + 1] == texts


async def _body(app: Any, path: str, body: dict[str, Any]) -> bytes:
    """What ``app`` (ASGI) streams back for ``body``."""
    sent: list[dict[str, Any]] = []
    msgs = [{"type": "http.request", "body": orjson.dumps(body), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if msgs:
            return msgs.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [
        (b"content-type", b"application/json")], "query_string": b""}
    await app(scope, receive, send)
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


_REQUEST = {"messages": [{"role": "user", "content": "count to ten"}], "stream": True,
            "max_tokens": 48, "logprobs": True, "top_logprobs": 0, "return_token_ids": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


@pytest.mark.parametrize("asked", ASKED)
def test_benchmark_upstream_stream(asked: ClientAsked) -> None:
    data = asyncio.run(_body(FastUpstream(), "/v1/chat/completions",
                             {**_REQUEST, "model": "bench"}))
    cap = same(cut(data, [333]), asked)
    assert cap.usage is not None
    assert len(cap.completion(0).token_ids) == cap.usage["completion_tokens"] >= 48
    assert cap.fast >= 40


@pytest.mark.parametrize("asked", ASKED)
def test_tokens_grouped_as_vllms_stream_interval_sends_them(asked: ClientAsked) -> None:
    """An engine started with ``--stream-interval 8`` sends the first token alone, then
    events of 8 tokens: both paths capture exactly the tokens, logprobs and text of the
    same call sent one token an event, and the fast path takes the grouped events."""
    body = {**_REQUEST, "model": "bench"}
    single = same(cut(asyncio.run(_body(FastUpstream(), "/v1/chat/completions", body)),
                      [333]), asked)
    data = asyncio.run(_body(FastUpstream(stream_interval=8), "/v1/chat/completions", body))
    grouped = same(cut(data, [333]), asked)
    one, many = single.completion(0), grouped.completion(0)
    assert many.token_ids == one.token_ids and len(many.token_ids) == 49
    assert many.logprobs == one.logprobs
    assert "".join(many.text) == "".join(one.text)
    events = [e for e in data.split(b"\n\n") if b'"token_ids":[' in e and b"usage" not in e]
    assert [e.count(b'"logprob":') for e in events] == [1, 8, 8, 8, 8, 8, 8]
    assert grouped.fast == 6  # every grouped token event but the finish


async def _sim_stream(asked_top: int) -> bytes:
    cfg = SimServerConfig(model="qwen3-14b", gpu="H100", speed=200, seed=1,
                          output_len_median=40)
    async with start_sim_servers([cfg]) as urls, aiohttp.ClientSession() as session:
        body = {**_REQUEST, "model": "qwen3-14b", "top_logprobs": asked_top}
        async with session.post(urls[0] + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            return await resp.read()


@pytest.mark.parametrize("asked", ASKED)
def test_simulated_server_stream(asked: ClientAsked) -> None:
    data = asyncio.run(_sim_stream(2 if asked.logprobs else 0))
    for sizes in ([], [97], [1]):
        cap = same(cut(data, sizes), asked)
        assert cap.usage is not None
        assert len(cap.completion(0).token_ids) == cap.usage["completion_tokens"] > 10
    assert cap.fast >= cap.chunks - 4
