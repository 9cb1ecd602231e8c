"""Abort-and-continue: finish a call that an engine aborted for a weight update.

When ``POST /admin/pause`` runs in ``abort-and-continue`` mode the engines abort what they
are generating (vLLM ``/pause?mode=abort``): each request ends with ``finish_reason:
"abort"`` and the tokens it had, except that a stream aborted before its first token
(still queued or prefilling) gets no finish chunk at all, only ``[DONE]`` (after the
role chunk on chat). The relay does not pass that end to the client. It holds the
client's request open, waits for ``/admin/resume``, and sends the same engine a
token-in continuation on ``/v1/completions``: the prompt token ids plus the completion
token ids so far as the prompt, ``max_tokens`` reduced by what was already generated.
The continuation's output is reshaped into the wire format the call asked the engine
for (chat chunks or a chat message for chat calls and for the front doors, which are
chat upstream and turn it into their own events) under the original response id, so
the client sees one answer with every token exactly once. Token-in is exact;
re-tokenizing the text is not.

Not every call can be continued that way: tool-call parsing, structured output
(``response_format``, guided decoding), ``n > 1`` and ``echo`` depend on the engine
seeing the whole generation in one request. A streamed one is frozen in place instead
(its engine is paused with ``keep``, see :mod:`gateway.live_calls`); one that is not
streamed, whose client has seen nothing yet, is sent again from the start after resume,
so that all its tokens come from the new weights.

Each part of an answer is stamped with the weight label its engine reported when it
resumed (``Backend.weight_version``); the boundary is the engine's own count of the
tokens it had made, the ones its abort's end carried.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from backends.base import ServerState
from gateway.errors import UpstreamError
from gateway.live_calls import continuable
from gateway.proxy import routes
from gateway.proxy.calls import CallContext
from gateway.proxy.lifecycle import move
from gateway.proxy.sse import SSEDecoder
from gateway.proxy.upstream import UPSTREAM_HEADERS, UpstreamBroken, UpstreamResponse, open_upstream
from gateway.runtime import Runtime
from gateway.store.routes import coverage

#: Sampling fields carried over to the continuation unchanged.
CARRIED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                  "ignore_eos", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "priority", "skip_special_tokens",
                  "include_stop_str_in_output", "spaces_between_special_tokens", "user",
                  "request_id")
_DONE = b"data: [DONE]\n\n"


def should_continue(rt: Runtime, ctx: CallContext) -> bool:
    """The engine aborted this call's generation: continue it (True) or pass the abort on."""
    cap = ctx.capture.completion(0)
    known = ctx.capture.prompt_ids is not None or not cap.token_ids  # else: cannot rebuild
    live = rt.live_calls
    go = (cap.finish_reason == "abort" and live.aborted(ctx.id) and ctx.lease is not None
          and ((continuable(ctx.body) and known) or not ctx.stream))
    if go:
        live.answered(ctx.id)
    return go


def _restart(ctx: CallContext) -> bool:
    """Aborted before the engine sent anything (no prompt ids yet), or not continuable
    token-in and not streamed (its client saw nothing): send the call again."""
    return ctx.capture.prompt_ids is None or (not ctx.stream and not continuable(ctx.body))


def continuation_body(ctx: CallContext) -> dict[str, Any] | None:
    """The token-in request that finishes ``ctx``; None if its token budget is spent."""
    body = ctx.body
    prompt = list(ctx.capture.prompt_ids or ())
    done = ctx.capture.completion(0).token_ids
    out: dict[str, Any] = {"model": body["model"], "prompt": prompt + done,
                           "return_token_ids": True, "stream": ctx.stream}
    for key in CARRIED_FIELDS:
        if key in body:
            out[key] = body[key]
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(limit, int):
        if limit - len(done) <= 0:
            return None
        out["max_tokens"] = limit - len(done)
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - len(done))
    if ctx.capture.chat:
        out["logprobs"] = int(body.get("top_logprobs") or 0)
    else:
        out["logprobs"] = body.get("logprobs", 0)
    if ctx.stream:
        out["stream_options"] = {"include_usage": True}
    held = coverage(ctx.capture.completion(0).routes)
    ctx.capture.routes_start = routes.ask(out, held[1] if held else 0, client_chose=False)
    return out


def _chat_logprobs(lp: Any) -> dict[str, Any] | None:
    if not isinstance(lp, dict):
        return None
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    content = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append({
            "token": token, "logprob": values[i] if i < len(values) else None,
            "bytes": list(str(token).encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(str(t).encode())}
                             for t, v in top.items()]})
    return {"content": content}


def _reshape(ctx: CallContext, payload: dict[str, Any], head: dict[str, Any],
             *, stream: bool) -> dict[str, Any]:
    """A continuation payload (``/v1/completions``) in the shape of the original call."""
    out: dict[str, Any] = {**payload, **head}
    out.pop("prompt_token_ids", None)
    choices = []
    for ch in payload.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        ch = {k: v for k, v in ch.items() if k != "prompt_token_ids"}
        if ctx.capture.chat:
            text = ch.pop("text", "") or ""
            if stream:
                ch["delta"] = {"content": text} if text else {}
            else:
                ch["message"] = {"role": "assistant", "content": text}
            ch["logprobs"] = _chat_logprobs(ch.get("logprobs"))
        choices.append(ch)
    out["choices"] = choices
    if isinstance(payload.get("usage"), dict):
        prompt = len(ctx.capture.prompt_ids or ())
        gen = len(ctx.capture.completion(0).token_ids) + sum(
            len(ch.get("token_ids") or ()) for ch in choices)
        out["usage"] = {"prompt_tokens": prompt, "completion_tokens": gen,
                        "total_tokens": prompt + gen}
    return out


async def _open(rt: Runtime, ctx: CallContext, body: dict[str, Any],
                path: str = "/v1/completions") -> UpstreamResponse:
    """Wait for resume, then send ``body`` to the engine that ran the call, or, when
    that engine takes no calls any more (retired by a relayout at the push, or taken out
    of rotation), to the one the scheduler places it on."""
    gate = rt.dispatcher.gate
    await gate.wait_open(rt.settings.dispatch.pause_max_wait_s)
    assert ctx.lease is not None
    backend = ctx.lease.backend
    if not backend.healthy or backend.state is not ServerState.READY:
        await move(rt, ctx)
        for key in ("model", "priority"):  # the adapter and priority it has there
            if key in ctx.body:
                body[key] = ctx.body[key]
        assert ctx.lease is not None
    rt.live_calls.continued(ctx.id)
    ctx.resume_mark = None  # the engine's own count (the abort's end) is the boundary
    label = ctx.lease.backend.weight_version or rt.weight_version
    ctx.segments.append((len(ctx.capture.completion(0).token_ids), label))
    ctx.continuations += 1
    ctx.capture.completion(0).finish_reason = None  # the continuation's end replaces it
    limits = rt.settings.upstream
    url, data = ctx.lease.backend.url + path, orjson.dumps(body)
    headers, deadline = UPSTREAM_HEADERS, time.monotonic() + limits.total_timeout_s
    try:
        upstream = await open_upstream(rt.session, url, data, headers, limits, deadline)
    except UpstreamBroken:  # a pooled connection the engine closed during the pause
        upstream = await open_upstream(rt.session, url, data, headers, limits, deadline)
    if upstream.status != 200:
        data = await upstream.read()
        upstream.close()
        raise UpstreamError(f"continuation answered {upstream.status}: "
                            f"{data[:300].decode(errors='replace')}")
    return upstream


def _strip_abort(payload: dict[str, Any]) -> bool:
    """Remove an ``abort`` finish from ``payload``'s choices; True if there was one."""
    found = False
    for ch in payload.get("choices") or ():
        if isinstance(ch, dict) and ch.get("finish_reason") == "abort":
            ch["finish_reason"] = None
            ch.pop("stop_reason", None)
            found = True
    return found


class HoldingDecoder(SSEDecoder):
    """The relay's SSE decoder that keeps an ``abort`` end (and what follows it: the usage
    chunk, ``[DONE]``) from the client while a continuation may follow."""

    def __init__(self, rt: Runtime, ctx: CallContext) -> None:
        super().__init__(ctx.capture, fast=rt.settings.capture.fast_relay)
        self._rt, self._ctx = rt, ctx
        self._live = rt.live_calls
        self.held = False
        self.head: dict[str, Any] | None = None

    def _run(self, buf: bytes, start: int, end: int) -> tuple[bytes, int]:
        if self.held:
            return b"", end
        out, stop = super()._run(buf, start, end)  # plain tokens: no end, nothing to hold
        if out:
            self._live.got_tokens(self._ctx.id)
            if self.head is None:
                self.head = stream_head(self._ctx, orjson.loads(out[6:out.index(b"\n\n")]))
        return out, stop

    def _event(self, event: bytes) -> bytes:
        if self.held:
            return b""
        if self._live.aborted(self._ctx.id) and self._ended_early(event):
            # vLLM sends no chunk for a request it aborts before its first token: the
            # usage chunk or [DONE] comes while the choice is unfinished (on
            # /v1/completions, with no chunk of the choice before it at all, so the
            # mark goes on a choice created here). Hold it and continue.
            cap = self._ctx.capture.choice(0)
            cap.finish_reason = "abort"
            if should_continue(self._rt, self._ctx):
                self.held = True
                return b""
            cap.finish_reason = None
        had = len(self._ctx.capture.completion(0).token_ids)
        out = super()._event(event)
        if len(self._ctx.capture.completion(0).token_ids) > had:
            self._live.got_tokens(self._ctx.id)  # when a frozen stream has settled
        if self.head is None and out.startswith(b"data: {"):
            self.head = stream_head(self._ctx, orjson.loads(out[6:]))
        first = self._ctx.capture.choices.get(0)
        if first is None or first.finish_reason != "abort":  # every event but an abort's
            return out
        if not should_continue(self._rt, self._ctx) or not out.startswith(b"data: {"):
            return out
        payload = orjson.loads(out[6:])
        self.held = True
        if _strip_abort(payload):
            return b"data: " + orjson.dumps(payload) + b"\n\n"
        return out

    def _ended_early(self, event: bytes) -> bool:
        """``[DONE]`` or a choice-less (usage) chunk before the choice finished."""
        if self._ctx.capture.completion(0).finish_reason is not None:
            return False
        data = event[5:].strip() if event.startswith(b"data:") else b""
        if data == b"[DONE]":
            return True
        if not data.startswith(b"{"):
            return False
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return False
        return isinstance(payload, dict) and payload.get("choices") == []


async def continue_stream(rt: Runtime, ctx: CallContext, head: dict[str, Any]
                          ) -> AsyncGenerator[bytes, None]:
    """The rest of an aborted stream, as chunks of the original call; ends with [DONE]."""
    while True:
        restart = _restart(ctx)
        body = dict(ctx.body) if restart else continuation_body(ctx)
        if body is None:  # nothing left to generate: end where the budget ended
            ctx.capture.choice(0).finish_reason = "length"
            yield _final_chunk(ctx, head, "length")
            yield _DONE
            return
        path = ("/v1/chat/completions" if ctx.capture.chat else "/v1/completions"
                ) if restart else "/v1/completions"
        upstream = await _open(rt, ctx, body, path)
        aborted, buf = False, b""
        try:
            async for chunk in upstream.chunks():
                buf += chunk.replace(b"\r\n", b"\n")
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: {"):
                        continue
                    raw = orjson.loads(ev[6:])
                    payload = ({**raw, **head} if restart
                               else _reshape(ctx, raw, head, stream=True))
                    had = len(ctx.capture.completion(0).token_ids)
                    ctx.capture.feed(payload, stream=True)
                    if len(ctx.capture.completion(0).token_ids) > had:
                        rt.live_calls.got_tokens(ctx.id)
                    if not payload:  # the usage chunk, which the client did not ask for
                        continue
                    if ctx.capture.completion(0).finish_reason == "abort":
                        aborted = True
                        if not _strip_abort(payload):
                            continue
                    elif aborted:
                        continue  # the aborted continuation's usage chunk
                    yield b"data: " + orjson.dumps(payload) + b"\n\n"
        finally:
            upstream.close()
        if not aborted:
            yield _DONE
            return
        if not should_continue(rt, ctx):
            yield _final_chunk(ctx, head, "abort")
            yield _DONE
            return


def _final_chunk(ctx: CallContext, head: dict[str, Any], reason: str) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if ctx.capture.chat:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"


def stream_head(ctx: CallContext, first: dict[str, Any] | None) -> dict[str, Any]:
    """id/object/created/model of the original response, for continuation chunks."""
    first = first or {}
    obj = "chat.completion.chunk" if ctx.capture.chat else "text_completion"
    return {"id": first.get("id", f"cont-{ctx.id}"), "object": first.get("object", obj),
            "created": first.get("created", int(time.time())),
            "model": first.get("model", ctx.body.get("model"))}


async def continue_whole(rt: Runtime, ctx: CallContext, payload: dict[str, Any]) -> None:
    """Finish a non-streamed aborted call in place: ``payload`` is what goes to the client."""
    head: dict[str, Any] = {k: payload[k] for k in ("id", "object", "created", "model")
                            if k in payload}
    target = payload["choices"][0]
    while should_continue(rt, ctx):
        if _restart(ctx):
            await _restart_whole(rt, ctx, payload, head)
            target = payload["choices"][0]
            continue
        body = continuation_body(ctx)
        if body is None:
            target["finish_reason"] = ctx.capture.choice(0).finish_reason = "length"
            break
        upstream = await _open(rt, ctx, body)
        try:
            more = _reshape(ctx, orjson.loads(await upstream.read()), head, stream=False)
        finally:
            upstream.close()
        ctx.capture.feed(more, stream=False)
        _merge(ctx, target, more["choices"][0] if more.get("choices") else {})
        if isinstance(more.get("usage"), dict):
            payload["usage"] = more["usage"]


async def _restart_whole(rt: Runtime, ctx: CallContext, payload: dict[str, Any],
                         head: dict[str, Any]) -> None:
    """Send the call again as the client sent it; its answer replaces ``payload``."""
    ctx.capture.choices.clear()  # what the aborted attempt made is not part of the answer
    ctx.segments.clear()
    path = "/v1/chat/completions" if ctx.capture.chat else "/v1/completions"
    upstream = await _open(rt, ctx, dict(ctx.body), path)
    try:
        fresh = orjson.loads(await upstream.read())
    finally:
        upstream.close()
    ctx.capture.feed(fresh, stream=False)
    payload.clear()
    payload.update({**fresh, **head})


def _merge(ctx: CallContext, target: dict[str, Any], more: dict[str, Any]) -> None:
    if ctx.capture.chat:
        msg = target.setdefault("message", {"role": "assistant", "content": ""})
        msg["content"] = (msg.get("content") or "") + (more.get("message") or {}).get(
            "content", "")
        if isinstance(target.get("logprobs"), dict) and isinstance(more.get("logprobs"), dict):
            target["logprobs"]["content"] += more["logprobs"].get("content") or []
    else:
        shift = len(target.get("text") or "")
        target["text"] = (target.get("text") or "") + (more.get("text") or "")
        lp, extra = target.get("logprobs"), more.get("logprobs")
        if isinstance(lp, dict) and isinstance(extra, dict):
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                lp[key] = (lp.get(key) or []) + (extra.get(key) or [])
            lp["text_offset"] = (lp.get("text_offset") or []) + [
                o + shift for o in extra.get("text_offset") or []]
    if "token_ids" in more and "token_ids" in target:
        target["token_ids"] = target["token_ids"] + more["token_ids"]
    target["finish_reason"] = more.get("finish_reason")
    target["stop_reason"] = more.get("stop_reason")
