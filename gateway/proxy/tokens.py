"""Token in: the engine runs on the tokens the model generated, not on a re-rendering.

A harness sends text. When it re-renders the model's earlier turn differently from what
the model generated (tool arguments re-serialized, a tool-call block re-rendered by the
chat template, decode-then-encode drift), the engine would be conditioned on tokens the
model never produced, and the record of that turn would no longer be a prefix of the
next prompt. RL frameworks avoid this inside their own agent loops by keeping token ids
(token in, token out); this module does it at the gateway for unmodified harnesses.

For a chat request that continues a branch of its trajectory (its messages re-send that
branch's last request, then the model's turn in some serialization that keeps every word
the model said, then new messages: :meth:`gateway.trajectories.branches.Tree.continuation`):

1. ``full`` = the engine's tokens for the request as sent (its ``/tokenize`` route, with
   the request's tools and template arguments). If ``full`` already extends the branch's
   recorded tokens, nothing is changed.
2. Otherwise ``head`` = the engine's tokens for the messages up to and including the
   model's turn, without a generation prompt. When ``full`` starts with ``head``, the new
   messages are ``full[len(head):]``.
3. The template closes an assistant turn with the same tokens whatever it said
   (``<|im_end|>`` and a newline in ChatML): the *closing*, found once per model as the
   common suffix of two probe turns that differ only in their text. ``head`` must end
   with it. The model generated the closing's first token when the turn stopped on it;
   the rest of the closing (``glue``) is the template's. A turn cut at ``max_tokens`` gets
   the whole closing, as the harness's history closes it.
4. The engine is sent ``record + glue + new`` as the prompt (vLLM:
   ``kv_transfer_params.prompt_token_ids`` on the chat route, so tool parsing and the
   answer's shape stay those of a chat call) and the call records ``kept_len``: how many
   prompt tokens came from the record.

Anything unexpected (a template whose rendering of the turn is not a prefix of the whole
or does not end with the closing, a tokenizer error or timeout) leaves the request as the
harness sent it; the call then opens a branch and is reported as a mismatch.

The same ``/tokenize`` answer clamps ``max_tokens`` to the context the prompt leaves.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import aiohttp
import orjson

from gateway.config import CaptureSettings

log = logging.getLogger(__name__)

#: chat fields that change how the engine renders the messages, passed to /tokenize too
_RENDER_FIELDS = ("tools", "chat_template_kwargs", "chat_template", "documents")
#: two assistant turns that differ only in their text: their common suffix is the closing
_PROBES = tuple([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}]
                for text in ("A", "Z"))
_MAX_TOKEN_KEYS = ("max_completion_tokens", "max_tokens")


class Tokenizer:
    """The engine's ``/tokenize`` route for one call, and what the answers told."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, body: dict[str, Any],
                 settings: CaptureSettings) -> None:
        self._session = session
        self._url = base_url + "/tokenize"
        self._body = body
        self._timeout = settings.tokenize_timeout_s
        self.max_model_len: int | None = None
        self.error: str | None = None  # why the last call answered None

    async def __call__(self, messages: list[Any], *, generation: bool) -> list[int] | None:
        req: dict[str, Any] = {"model": self._body["model"], "messages": messages,
                               "add_generation_prompt": generation}
        req.update({k: self._body[k] for k in _RENDER_FIELDS if self._body.get(k) is not None})
        try:
            async with asyncio.timeout(self._timeout), self._session.post(
                    self._url, data=orjson.dumps(req),
                    headers={"content-type": "application/json"}) as resp:
                data = await resp.read()
                if resp.status != 200:
                    self.error = (f"the engine's /tokenize answered {resp.status}: "
                                  f"{data[:300].decode(errors='replace')}")
                    log.debug("%s", self.error)
                    return None
            out = orjson.loads(data)
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            self.error = f"the engine's /tokenize failed: {type(exc).__name__}: {exc}"
            log.debug("%s", self.error)
            return None
        if isinstance(out.get("max_model_len"), int):
            self.max_model_len = out["max_model_len"]
        tokens = out.get("tokens")
        return tokens if isinstance(tokens, list) else None


async def closing_of(tok: Tokenizer) -> list[int] | None:
    """The tokens the engine's template closes every assistant turn with."""
    a, z = [await tok(list(probe), generation=False) for probe in _PROBES]
    if not a or not z:
        return None
    n = 0
    while n < min(len(a), len(z)) and a[-1 - n] == z[-1 - n]:
        n += 1
    return a[len(a) - n:] if n else None


async def record_prompt(tok: Tokenizer, body: dict[str, Any], record: list[int],
                        turn_end: int, closing: list[int] | None
                        ) -> tuple[list[int] | None, list[int] | None]:
    """``(prompt, full)``: the prompt to run (the record, then the new messages as the
    engine renders them), or None where the engine's own rendering already extends the
    record or the two cannot be joined; ``full`` is the rendering of the whole request."""
    messages = body["messages"]
    full = await tok(messages, generation=True)
    if full is None or full[:len(record)] == record or not closing or not record:
        return None, full
    head = await tok(messages[:turn_end], generation=False)
    if head is None or full[:len(head)] != head or head[-len(closing):] != closing:
        return None, full
    glue = closing[1:] if record[-1] == closing[0] else closing
    return record + glue + full[len(head):], full


def clamp_max_tokens(body: dict[str, Any], prompt_len: int, max_model_len: int | None) -> None:
    """Lower the call's token limit to what ``prompt_len`` leaves of the context."""
    if max_model_len is None:
        return
    left = max_model_len - prompt_len
    for key in _MAX_TOKEN_KEYS:
        value = body.get(key)
        if isinstance(value, int) and value > left > 0:
            body[key] = left


def needs_count(body: dict[str, Any], size: int, max_model_len: int | None) -> bool:
    """Whether the call's token limit could overrun the context (then its prompt must be
    counted); ``size``: the request's bytes as received. Without a known context length,
    any explicit limit could."""
    limit = max((v for k in _MAX_TOKEN_KEYS if isinstance(v := body.get(k), int)), default=None)
    if limit is None:
        return False
    if max_model_len is None:
        return True
    # a prompt has at most one token per byte of its text, plus its template's text
    bound = size + 64 * len(body.get("messages") or ())
    return limit + bound > max_model_len


class Planned(NamedTuple):
    """What :meth:`PromptPlanner.plan` did: prompt tokens taken from the record (None: the
    request runs as rendered), and whether the prompt the engine runs extends the record
    (the routes the branch holds are then the new prompt's first ones)."""

    kept: int | None
    extends: bool


class PromptPlanner:
    """Runs before a chat call goes upstream (once, on the first backend it is sent to):
    token in where the harness re-rendered the model's turn, and the max_tokens clamp."""

    def __init__(self, session: aiohttp.ClientSession, settings: CaptureSettings) -> None:
        self._session = session
        self._settings = settings
        self._context: dict[str, int] = {}  # served model -> its max_model_len, once seen
        self._closing: dict[str, list[int] | None] = {}  # served model -> its turn closing
        self.routes_new_only = settings.routes_new_only
        self.kept = 0  # calls whose prompt came partly from the record
        self.unjoined = 0  # calls that continued a branch but could not be joined to it

    async def plan(self, body: dict[str, Any], base_url: str, *, size: int,
                   record: list[int] | None, turn_end: int) -> Planned:
        """Rewrite ``body`` in place; the number of prompt tokens taken from the record
        (``record`` given: the request continues a branch whose turn it echoed), and
        whether the prompt the engine runs starts with the record."""
        model = str(body.get("model"))
        known = self._context.get(model)
        use_record = record is not None and self._settings.token_in
        clamp = self._settings.clamp_max_tokens and needs_count(body, size, known)
        if not use_record and not clamp:
            return Planned(None, False)
        tok = Tokenizer(self._session, base_url, body, self._settings)
        prompt: list[int] | None = None
        if use_record:
            assert record is not None
            if self._closing.get(model) is None:  # (asked again after a failed probe)
                self._closing[model] = await closing_of(tok)
            prompt, full = await record_prompt(tok, body, record, turn_end,
                                               self._closing[model])
            if prompt is None and full is not None and full[:len(record)] != record:
                self.unjoined += 1
        else:
            full = await tok(body["messages"], generation=True)
        if tok.max_model_len is not None:
            self._context[model] = tok.max_model_len
        if clamp:
            counted = prompt if prompt is not None else full
            if counted is not None:
                clamp_max_tokens(body, len(counted), tok.max_model_len)
        if prompt is None:
            extends = bool(record) and full is not None and full[:len(record or ())] == record
            return Planned(None, extends)
        params = body.get("kv_transfer_params")
        body["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}),
                                      "prompt_token_ids": prompt}
        self.kept += 1
        return Planned(len(record or ()), True)
