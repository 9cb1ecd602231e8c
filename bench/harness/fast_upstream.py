"""An OpenAI-shaped upstream that answers at once, for the overhead and store benchmarks.

It speaks vLLM's wire format for token capture (``docs/real-vllm-wire-format.md``):
``prompt_token_ids`` / ``token_ids`` when ``return_token_ids`` is set, per-token logprobs
when ``logprobs`` is set, streaming (one SSE event per token, the role chunk first, or
with ``stream_interval`` N as vLLM's ``--stream-interval N`` sends them: the first token
at once, then N tokens an event, the last event at the finish) and not. It is a raw ASGI
app (no framework) so that it costs as little as possible.

Its tokenizer is word-level and exact: token id ``i`` is the ``i``-th word of a bijective
base-26 numbering (``a``, ``b``, ..., ``z``, ``aa``, ...), so generated text echoed back
by a harness tokenizes to the same ids and every prompt of a trajectory extends the
previous prompt+completion token for token, as with a real chat model. Generated ids
follow a Zipf law over ranks with low ids the most frequent (as in BPE vocabularies,
where early merges are the frequent tokens); words are 1-4 letters, ~4.5 bytes a token.

Run it in its own process: ``python -m bench.harness.fast_upstream --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
import zlib
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any

import numpy as np
import orjson

VOCAB = 151_643  # Qwen-sized word vocabulary; specials follow
IM_START, IM_END = 151_644, 151_645
ROLE_IDS = {"system": 8_948, "user": 872, "assistant": 77_091, "tool": 14_172}
MODEL = "bench"
_TABLE = 1 << 20

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def word(i: int) -> str:
    """The word of token id ``i`` (bijective base 26)."""
    out, n = [], i + 1
    while n:
        n, r = divmod(n - 1, 26)
        out.append(chr(97 + r))
    return "".join(reversed(out))


def word_id(w: str) -> int:
    n = 0
    for ch in w:
        n = n * 26 + (ord(ch) - 96)
    return n - 1


@cache
def words() -> list[str]:
    return [word(i) for i in range(VOCAB)]


@cache
def zipf_table(seed: int = 7) -> tuple[list[int], list[float]]:
    """A fixed stream of sampled ids (Zipf, s=1.1) and their logprobs."""
    rng = np.random.default_rng(seed)
    ranks = rng.zipf(1.1, size=_TABLE * 2)
    ids = ranks[ranks <= VOCAB][:_TABLE] - 1
    lps = -rng.exponential(0.6, size=len(ids)).astype(np.float32)
    return ids.tolist(), lps.tolist()


def sample(n: int, offset: int) -> tuple[list[int], list[float]]:
    ids, lps = zipf_table()
    start = offset % (len(ids) - n - 1)
    return ids[start:start + n], lps[start:start + n]


def text_of(ids: list[int]) -> str:
    table = words()
    return " ".join(table[i] for i in ids)


class Tokenizer:
    """Word-level, exact on generated text; unknown words map to a stable hash id."""

    def __init__(self, cache_size: int = 200_000) -> None:
        self._cache: dict[str, list[int]] = {}
        self._size = cache_size

    def encode(self, content: str) -> list[int]:
        hit = self._cache.get(content)
        if hit is not None:
            return hit
        ids = [_piece_id(w) for w in content.split()]
        if len(self._cache) >= self._size:
            self._cache.clear()
        self._cache[content] = ids
        return ids

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat template: ``<im_start> role content <im_end>`` per message, then the
        assistant header."""
        out: list[int] = []
        for m in messages:
            content = m.get("content")
            out.append(IM_START)
            out.append(ROLE_IDS.get(str(m.get("role")), 872))
            if isinstance(content, str):
                out.extend(self.encode(content))
            out.append(IM_END)
        out.append(IM_START)
        out.append(ROLE_IDS["assistant"])
        return out


def _piece_id(w: str) -> int:
    if 0 < len(w) <= 4 and w.isascii() and w.isalpha() and w.islower():
        i = word_id(w)
        if i < VOCAB:
            return i
    return zlib.crc32(w.encode()) % VOCAB


class FastUpstream:
    """The ASGI app."""

    def __init__(self, default_tokens: int = 16, interval_s: float = 0.0,
                 stream_interval: int = 1) -> None:
        self.tok = Tokenizer()
        self.default_tokens = default_tokens
        self.interval_s = interval_s  # between decode steps (0: every event at once)
        self.stream_interval = stream_interval  # tokens an event (vLLM's --stream-interval)
        self.served = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/health", "/v1/models"):
            body = b"{}" if path == "/health" else orjson.dumps(
                {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            await _respond(send, 200, body)
            return
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            await _respond(send, 404, b'{"error":{"message":"not found"}}')
            return
        req = orjson.loads(await _read(receive))
        self.served += 1
        chat = path == "/v1/chat/completions"
        answer = Answer(req, self._prompt(req, chat), chat, self.served, self.default_tokens)
        if req.get("stream") is True:
            await answer.stream(send, self.interval_s, self.stream_interval)
        else:
            await _respond(send, 200, orjson.dumps(answer.whole()))

    def _prompt(self, req: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            return self.tok.render(req.get("messages") or [])
        prompt = req.get("prompt")
        if isinstance(prompt, list):
            return [int(x) for x in prompt]
        return self.tok.encode(str(prompt))


class Answer:
    """One completion: ids, logprobs and text, shaped as vLLM shapes them."""

    def __init__(self, req: dict[str, Any], prompt: list[int], chat: bool, serial: int,
                 default_tokens: int) -> None:
        n = req.get("max_tokens") or req.get("max_completion_tokens") or default_tokens
        self.ids, self.lps = sample(int(n), serial * 7919 + len(prompt))
        self.ids = [*self.ids, IM_END]
        self.lps = [*self.lps, -0.01]
        self.prompt, self.chat = prompt, chat
        self.want_ids = req.get("return_token_ids") is True
        self.want_lp = req.get("logprobs") not in (None, False)
        self.usage_in_stream = bool((req.get("stream_options") or {}).get("include_usage"))
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{serial}"
        self.created = int(time.time())

    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt), len(self.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _logprobs(self, lo: int, hi: int) -> dict[str, Any] | None:
        if not self.want_lp:
            return None
        table = words()
        toks = [table[i] if i < VOCAB else "<|im_end|>" for i in self.ids[lo:hi]]
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                 "top_logprobs": []}
                                for t, lp in zip(toks, self.lps[lo:hi], strict=True)]}
        return {"tokens": toks, "token_logprobs": self.lps[lo:hi],
                "top_logprobs": [{t: lp} for t, lp in zip(toks, self.lps[lo:hi], strict=True)]}

    def whole(self) -> dict[str, Any]:
        text = text_of(self.ids[:-1])
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(0, len(self.ids)),
                                  "finish_reason": "stop", "stop_reason": None,
                                  "token_ids": self.ids if self.want_ids else None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            choice["prompt_token_ids"] = self.prompt if self.want_ids else None
        body: dict[str, Any] = {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": MODEL, "choices": [choice],
            "usage": self.usage()}
        if self.chat:
            body["prompt_token_ids"] = self.prompt if self.want_ids else None
        return body

    def events(self, stream_interval: int = 1) -> list[tuple[dict[str, Any], int]]:
        """The stream's events, each with the decode steps it took (its tokens; 1 for the
        others): the role chunk, then the tokens, the first alone and then
        ``stream_interval`` an event (as vLLM groups them), then the usage chunk if
        asked."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        head = {"id": self.id, "object": obj, "created": self.created, "model": MODEL}
        out: list[tuple[dict[str, Any], int]] = []
        if self.chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}
            out.append(({**head, "choices": [role],
                         "prompt_token_ids": self.prompt if self.want_ids else None}, 1))
        table = words()
        n = len(self.ids)
        cuts = [0, *range(1, n, max(1, stream_interval)), n]
        for lo, hi in itertools.pairwise(cuts):
            last = hi == n
            piece = "".join("" if k == n - 1 else ("" if k == 0 else " ") + table[self.ids[k]]
                            for k in range(lo, hi))
            ch: dict[str, Any] = {"index": 0}  # in vLLM's key order
            if self.chat:
                ch["delta"] = {"content": piece}
            else:
                ch["text"] = piece
            ch["logprobs"] = self._logprobs(lo, hi)
            ch["finish_reason"] = "stop" if last else None
            if last:
                ch["stop_reason"] = None
            if self.want_ids:
                ch["token_ids"] = self.ids[lo:hi]
                if not self.chat and lo == 0:
                    ch["prompt_token_ids"] = self.prompt
            out.append(({**head, "choices": [ch]}, hi - lo))
        if self.usage_in_stream:
            out.append(({**head, "choices": [], "usage": self.usage()}, 1))
        return out

    async def stream(self, send: Send, interval_s: float = 0.0,
                     stream_interval: int = 1) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"),
                                (b"cache-control", b"no-cache")]})
        for chunk, steps in self.events(stream_interval):
            await send({"type": "http.response.body",
                        "body": b"data: " + orjson.dumps(chunk) + b"\n\n", "more_body": True})
            if interval_s:  # an engine's decode steps, one token each
                await asyncio.sleep(interval_s * steps)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})


async def _read(receive: Receive) -> bytes:
    parts = []
    while True:
        msg = await receive()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            words()
            zipf_table()
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--interval-ms", type=float, default=0.0,
                    help="between a streamed call's decode steps (one token each)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens an event after the first, as vLLM's --stream-interval")
    args = ap.parse_args()
    uvicorn.run(FastUpstream(interval_s=args.interval_ms / 1000,
                             stream_interval=args.stream_interval), host=args.host,
                port=args.port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools", lifespan="on")


if __name__ == "__main__":
    main()
