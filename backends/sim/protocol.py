"""Wire types of the simulated server: request bodies, the error envelope, logprobs.

Bodies are validated with permissive pydantic models (unknown sampling fields such as
``temperature`` are accepted and ignored, as a random-weight model would effectively do)
and failures become OpenAI's error envelope with status 400, like vLLM.
"""

from __future__ import annotations

import random
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from backends.sim.tokenizer import SimTokenizer


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    priority: int = 0
    seed: int | None = None
    #: vLLM's request id (``chatcmpl-<request_id>``), e.g. to abort it by name
    request_id: str | None = None
    #: routed experts of prompt positions before this one are left out of the answer
    #: (``backends.sim.routes``)
    routed_experts_prompt_start: int = Field(default=0, ge=0)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


BodyT = TypeVar("BodyT", bound=BaseModel)


class ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    #: vLLM's channel for a prompt already tokenized by the caller: with
    #: ``{"prompt_token_ids": [...]}`` the engine runs on those ids instead of rendering
    #: ``messages`` (which still drive tool parsing and the answer's shape)
    kv_transfer_params: dict[str, Any] | None = None


class TokenizeBody(BaseModel):
    """vLLM's ``POST /tokenize``: a chat (``messages``) or a plain ``prompt``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeBody(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text (one string for the list)."""

    model: str | None = None
    tokens: list[int]


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class APIError(Exception):
    """An error to answer in OpenAI's envelope."""

    def __init__(self, status: int, message: str, *, type_: str = "BadRequestError",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code or str(status)

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return json_response(body, status=self.status)


async def json_object(request: Request) -> dict[str, Any]:
    """A control route's body: a JSON object, or APIError(400)."""
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """Validated body, or APIError(400) for malformed JSON or invalid fields."""
    try:
        raw = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"invalid request: {param}: {first.get('msg')}", param=param) from None


def _logprob(seed: int, pos: int) -> float:
    """Cheap deterministic pseudo-logprob of the token at ``pos`` (in (-2, 0])."""
    return -((hash((seed, pos)) & 0xFFFF) / 32768.0) ** 2 / 2


def token_logprobs(tok: SimTokenizer, ids: list[int], top: int, seed: int, start: int = 0
                   ) -> list[dict[str, Any]]:
    """Chat-style ``logprobs.content`` entries for ``ids`` at output positions ``start``...

    Values depend only on (seed, position), so streamed chunks and a non-streamed
    response agree. With ``top`` > 0 the sampled token comes first among ``top``
    alternatives with decreasing logprobs (a valid top-k list).
    """
    out: list[dict[str, Any]] = []
    for pos, i in enumerate(ids, start):
        lp = _logprob(seed, pos)
        entry: dict[str, Any] = {"token": tok.token_str(i), "logprob": lp,
                                 "bytes": tok.token_bytes(i), "top_logprobs": []}
        if top:
            rng = random.Random(hash((seed, pos, "top")))
            alts = [i, *tok.sample_words(rng, top - 1)]
            lps = [lp]
            for _ in alts[1:]:
                lps.append(lps[-1] - 1.0 - rng.random())
            entry["top_logprobs"] = [
                {"token": tok.token_str(a), "logprob": v, "bytes": tok.token_bytes(a)}
                for a, v in zip(alts, lps, strict=True)
            ]
        out.append(entry)
    return out


def completion_logprobs(entries: list[dict[str, Any]], offset0: int) -> dict[str, Any]:
    """Legacy ``/v1/completions`` logprobs shape built from chat-style entries."""
    offsets, pos = [], offset0
    for e in entries:
        offsets.append(pos)
        pos += len(bytes(e["bytes"]).decode("utf-8", errors="replace"))
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} or None
                         for e in entries],
        "text_offset": offsets,
    }
