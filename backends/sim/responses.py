"""Shaping planned completions into vLLM-compatible JSON and SSE chunks.

A :class:`Choice` is one generated sequence (``n`` of them per request). Its visible text
is fixed when it is planned, and ``offsets[k]`` is how much of that text the first ``k+1``
tokens reveal, so streamed deltas concatenate to exactly the non-streamed content.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from backends.sim.chat import Completion, output_piece
from backends.sim.driver import Delta, RequestHandle
from backends.sim.protocol import completion_logprobs, token_logprobs
from backends.sim.request import FinishReason
from backends.sim.routes import RouteAsk
from backends.sim.tokenizer import TOOL_CALL_START, SimTokenizer


@dataclass(slots=True, eq=False)
class Choice:
    index: int
    comp: Completion
    seed: int
    content: str  # visible text (tool call markup and text after a stop string removed)
    offsets: list[int]
    handle: RequestHandle | None = None
    sent: int = 0  # tokens already streamed

    @classmethod
    def plan(cls, tok: SimTokenizer, index: int, comp: Completion, seed: int) -> Choice:
        pieces = [output_piece(tok, i) for i in comp.ids]
        text = "".join(pieces)
        if comp.tool_call is not None:
            text = text[: text.find(TOOL_CALL_START)]
        elif comp.text_len is not None:
            text = text[: comp.text_len]
        offsets, pos = [], 0
        for p in pieces:
            pos = min(pos + len(p), len(text))
            offsets.append(pos)
        return cls(index, comp, seed, text, offsets)

    @property
    def aborted(self) -> bool:
        return self.handle is not None and self.handle.finish == FinishReason.ABORT

    @property
    def num_out(self) -> int:
        """Tokens this choice produced: all of them, or what it had when aborted."""
        if self.aborted:
            assert self.handle is not None
            return min(self.handle.num_generated, len(self.comp.ids))
        return len(self.comp.ids)

    @property
    def finish_reason(self) -> str:
        return "abort" if self.aborted else self.comp.finish_reason

    def text_between(self, a: int, b: int) -> str:
        start = self.offsets[a - 1] if a > 0 else 0
        return self.content[start: self.offsets[b - 1]] if b > 0 else ""

    def tool_calls(self) -> list[dict[str, Any]]:
        tc = self.comp.tool_call
        if tc is None:
            return []
        return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": tc.name, "arguments": tc.arguments}}]


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
    gen = sum(c.num_out for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": gen,
            "total_tokens": prompt_tokens + gen, "prompt_tokens_details": None}


@dataclass(slots=True)
class ResponseShape:
    """Everything per request that chunk/response builders need."""

    tok: SimTokenizer
    rid: str
    model: str
    prompt_ids: list[int]
    chat: bool
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    created: int = 0
    routes: RouteAsk | None = None  # --enable-return-routed-experts (non-streamed answers)

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def _logprobs(self, c: Choice, a: int, b: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        entries = token_logprobs(self.tok, c.comp.ids[a:b], self.top_logprobs, c.seed, a)
        if self.chat:
            return {"content": entries}
        return completion_logprobs(entries, c.offsets[a - 1] if a > 0 else 0)

    def full_choice(self, c: Choice) -> dict[str, Any]:
        """A non-streamed choice."""
        n = c.num_out
        out: dict[str, Any] = {"index": c.index, "logprobs": self._logprobs(c, 0, n),
                               "finish_reason": c.finish_reason,
                               "stop_reason": None if c.aborted else c.comp.stop_reason}
        text = c.text_between(0, n) if c.aborted else c.content
        if self.chat:
            calls = [] if c.aborted else c.tool_calls()
            content = text if text or not calls else None
            out["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
        else:
            out["text"] = text
        if self.return_token_ids:
            out["token_ids"] = list(c.comp.ids[:n])
            if not self.chat:
                out["prompt_token_ids"] = self.prompt_ids
        if self.routes is not None:
            out["routed_experts"] = self.routes.field(self.prompt_ids + list(c.comp.ids[:n]),
                                                      forwarded=n > 0)
        return out

    def full_response(self, choices: list[Choice]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model,
            "choices": [self.full_choice(c) for c in choices],
            "usage": usage(len(self.prompt_ids), choices),
        }
        if self.return_token_ids and self.chat:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def chunk(self, choice_body: dict[str, Any], *, first: bool = False) -> bytes:
        body: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": [choice_body]}
        if first and self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def first_chunk(self, c: Choice) -> bytes:
        if self.chat:
            return self.chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}, first=True)
        return self.chunk({"index": c.index, "text": "", "logprobs": None,
                           "finish_reason": None}, first=True)

    def delta_chunk(self, c: Choice, delta: Delta) -> bytes:
        a, b = c.sent, min(c.sent + delta.num_new, len(c.comp.ids))
        c.sent = b
        text = c.text_between(a, b)
        finish = c.finish_reason if delta.finish is not None else None
        body: dict[str, Any] = {"index": c.index}  # in vLLM's key order
        if self.chat:
            body["delta"] = {"content": text} if text else {}
            if finish == "tool_calls":
                calls = [{"index": 0, **tc} for tc in c.tool_calls()]
                body["delta"]["tool_calls"] = calls
        else:
            body["text"] = text
        body["logprobs"] = self._logprobs(c, a, b)
        body["finish_reason"] = finish
        if finish is not None:
            body["stop_reason"] = None if c.aborted else c.comp.stop_reason
        if self.return_token_ids:
            body["token_ids"] = list(c.comp.ids[a:b])
        return self.chunk(body)

    def usage_chunk(self, choices: list[Choice]) -> bytes:
        body: dict[str, Any] = {
                "id": self.rid, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": usage(len(self.prompt_ids), choices)}
        return b"data: " + orjson.dumps(body) + b"\n\n"


async def merged_deltas(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Delta]]:
    """Deltas of all choices in arrival order, until every choice has finished."""
    if len(choices) == 1:
        handle = choices[0].handle
        assert handle is not None
        async for d in handle.deltas():
            yield choices[0], d
        return
    queue: asyncio.Queue[tuple[Choice, Delta]] = asyncio.Queue()

    async def forward(c: Choice) -> None:
        assert c.handle is not None
        async for d in c.handle.deltas():
            queue.put_nowait((c, d))

    tasks = [asyncio.create_task(forward(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            c, d = await queue.get()
            remaining -= d.finish is not None
            yield c, d
    finally:
        for t in tasks:
            t.cancel()
