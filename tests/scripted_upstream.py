"""A vLLM-shaped upstream whose behaviour each test scripts (hang, 5xx, slow stream).

Its wire format follows docs/real-vllm-wire-format.md. It records every request it saw
and whether the client closed the connection before the answer finished, so tests can
assert what reached (and left) the backend.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Script:
    mode: str = "ok"  # ok | hang | error500 | error500text | error501 | error400 | slow
    tokens: int = 5
    token_delay_s: float = 0.0
    tail_delay_s: float = 0.0  # between the last token and the end of the stream
    model: str = "scripted"
    finish_reason: str = "length"
    error_message: str = "boom"  # what error500 says
    completions: bool = False  # /v1/completions too, for its error modes (answers chat-shaped)


@dataclass
class Seen:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    closed_early: int = 0
    completed: int = 0


def make_upstream(script: Script, seen: Seen) -> Starlette:
    counter = itertools.count(1000)

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        seen.bodies.append(body)
        if script.mode == "hang":  # never answers; notices the caller leaving, as vLLM does
            while (await request.receive())["type"] != "http.disconnect":
                pass
            seen.closed_early += 1
            return Response(status_code=499)
        if script.mode == "error500":
            return JSONResponse({"error": {"message": script.error_message,
                                           "type": "InternalServerError", "param": None,
                                           "code": 500}}, status_code=500)
        if script.mode == "error500text":  # a crashed server's page, not JSON
            return Response(b"Internal Server Error", status_code=500, media_type="text/plain")
        if script.mode == "error501":  # vLLM on a feature it does not implement
            return JSONResponse({"error": {"message": "logit_bias is not supported",
                                           "type": "NotImplementedError", "param": None,
                                           "code": 501}}, status_code=501)
        if script.mode == "error400":  # the engine refusing the request (vLLM's shape)
            return JSONResponse({"object": "error", "message": "max_tokens is too large",
                                 "type": "BadRequestError", "param": None, "code": 400},
                                status_code=400)
        prompt = [1, 2, 3, len(body.get("messages", []))]
        ids = [next(counter) for _ in range(script.tokens)]
        if body.get("stream"):
            return StreamingResponse(_stream(body, prompt, ids), media_type="text/event-stream")
        seen.completed += 1
        return JSONResponse({
            "id": "chatcmpl-x", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * len(ids)},
                         "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120],
                                                   "top_logprobs": []} for _ in ids]},
                         "finish_reason": script.finish_reason, "token_ids": ids}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)},
            "prompt_token_ids": prompt,
        })

    async def _stream(body: dict[str, Any], prompt: list[int], ids: list[int]) -> Any:
        try:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                        "prompt_token_ids": prompt})
            for i, tok in enumerate(ids):
                if script.token_delay_s:
                    await asyncio.sleep(script.token_delay_s)
                yield _sse({"choices": [{"index": 0, "delta": {"content": "x"},
                                         "logprobs": {"content": [{"token": "x", "logprob": -0.5,
                                                                   "top_logprobs": []}]},
                                         "finish_reason": (script.finish_reason
                                                           if i == len(ids) - 1 else None),
                                         "token_ids": [tok]}]})
            if script.tail_delay_s:
                await asyncio.sleep(script.tail_delay_s)
            yield b"data: [DONE]\n\n"
            seen.completed += 1
        except (asyncio.CancelledError, GeneratorExit, OSError):
            seen.closed_early += 1
            raise

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": script.model, "object": "model"}]})

    completions = [Route("/v1/completions", chat, methods=["POST"])] if script.completions else []
    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]), *completions,
        Route("/health", health), Route("/v1/models", models),
    ])


def _sse(payload: dict[str, Any]) -> bytes:
    payload.setdefault("object", "chat.completion.chunk")
    return b"data: " + orjson.dumps(payload) + b"\n\n"
