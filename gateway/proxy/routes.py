"""Routed experts (MoE routing replay): what each call records, asking only for new positions.

A mixture-of-experts engine started with ``--enable-return-routed-experts`` (vLLM 0.32)
adds ``routed_experts`` to every choice of a non-streamed answer: base64 of a NumPy
``.npy`` array ``(positions, layers, top_k)`` of the experts each forwarded position was
routed to, from the request's ``routed_experts_prompt_start`` on (the last sampled token
was never forwarded and has none). See docs/real-vllm-wire-format.md and docs/moe.md.

The gateway holds each trajectory's tokens, so it asks only for what it lacks: a request
whose prompt extends a branch of its trajectory (token in, or the engine's own rendering
already extends the record, :mod:`gateway.proxy.tokens`) asks from the end of the
routes that branch already holds (``Branch.routes_end``); a continuation after a weight
update asks from the end of what its call has so far. The field is sent only when the
start is above 0 and the branch holds routes, so a dense model (or an engine without the
flag) never sees it: capture costs nothing there.

Streamed answers carry no routes (vLLM's streaming paths never set them). For a streamed
call on an engine that returns routes, :func:`fill` asks the same engine, before the
stream ends for the client, for the routes of the call's sequence from the same start: a
prefill-only token-in request (the sequence but its last token; one token generated,
then dropped) whose prefix the engine has cached, sent only while the engine still holds
the weights that made the call's tokens. An engine not yet seen to return routes is
asked by one stream at a time (the probe); one that answers whole without routes is not
asked again (a refusal or a timeout says nothing of it); an engine paused for a weight
update is not asked.

A call keeps what it received as ``[start, base64]`` pieces (no decoding on the request
path); the trace writer merges them into one ``.npy`` (:func:`gateway.store.routes.merge`)
from ``calls.routes_start``, stored in a segment file (:mod:`gateway.store.route_files`) or
in ``calls.routes``; the samples align them with the tokens (:mod:`gateway.store.samples`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson

from gateway.proxy.calls import CallContext
from gateway.proxy.capture import ROUTES_START
from gateway.proxy.upstream import UPSTREAM_HEADERS
from gateway.runtime import Runtime

log = logging.getLogger(__name__)

#: how long a stream's end waits for its routes (then it ends without them)
FILL_TIMEOUT_S = 10.0


def ask(body: dict[str, Any], start: int, *, client_chose: bool) -> int:
    """Ask the engine for routes from ``start`` (the positions before it are held); the
    start the answer's routes will have. The client's own choice stands."""
    if client_chose:  # vLLM's pydantic takes "3" as 3
        value = body.get(ROUTES_START)
        try:
            return max(0, int(value))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return 0
    if start > 0 and "truncate_prompt_tokens" not in body:  # a cut prompt may be shorter
        body[ROUTES_START] = start
        return start
    body.pop(ROUTES_START, None)
    return 0


def wants_fill(ctx: CallContext) -> bool:
    """Whether a streamed call that ended whole should ask its engine for routes: the
    engine returns them (or has not been seen to and no probe is out) and the client did
    not choose."""
    lease = ctx.lease
    if lease is None or not ctx.stream or ctx.capture.asked.routes:
        return False
    b = lease.backend
    known = b.returns_routes is True or (b.returns_routes is None and not b.routes_probe)
    cap = ctx.capture.completion(0)
    return (known and ctx.capture.prompt_ids is not None and bool(cap.token_ids)
            and ctx.capture.generated_all() and len(ctx.capture.choices) == 1
            and not ctx.version_starts())  # one that spanned a weight update: the engine
    # would route its earlier tokens under the new weights


def _same_weights(rt: Runtime, ctx: CallContext, version: str) -> bool:
    """Whether the call's engine still serves the weights that made its last tokens."""
    if ctx.served and ctx.body.get("model") != ctx.served:
        return True  # a LoRA adapter: its name pins its weights (unloaded: a 404)
    assert ctx.lease is not None
    return (ctx.lease.backend.weight_version or rt.version_of(ctx.model or ctx.served)) \
        == version


async def fill(rt: Runtime, ctx: CallContext) -> bool:
    """Ask a streamed call's engine for the routes of its sequence (module doc); True when
    they were added to the call's capture. Never raises for the engine's sake: a call
    without routes is still a whole call.

    The request's prompt is the call's sequence but its last token, so it never exceeds
    the context the call itself fit in, and its routes end where a non-streamed answer's
    do (the last token's route would only matter for a token after it). The call leaves
    the live calls first: it has nothing left for a weight update to abort or wait on."""
    assert ctx.lease is not None
    rt.live_calls.remove(ctx.id)
    backend = ctx.lease.backend
    version = ctx.weight_version
    if rt.dispatcher.gate.paused or backend.id in rt.live_calls.paused:
        return False  # a weight update is on: the engine would answer on the new weights
    if not _same_weights(rt, ctx, version):
        return False  # the engine moved on to other weights: its routes would be theirs
    sequence = list(ctx.capture.prompt_ids or ()) + ctx.capture.completion(0).token_ids
    start = ctx.capture.routes_start
    if start > len(sequence) - 1:
        return False
    body: dict[str, Any] = {"model": ctx.body["model"], "prompt": sequence[:-1],
                            "max_tokens": 1, "request_id": f"{ctx.id}-routes"}
    if start > 0:
        body[ROUTES_START] = start
    if "priority" in ctx.body:
        body["priority"] = ctx.body["priority"]
    probing = backend.returns_routes is None
    backend.routes_probe = backend.routes_probe or probing  # one probe at a time
    try:
        return await _ask(rt, ctx, body, start, version)
    finally:
        if probing:
            backend.routes_probe = False


async def _ask(rt: Runtime, ctx: CallContext, body: dict[str, Any], start: int,
               version: str) -> bool:
    assert ctx.lease is not None
    backend = ctx.lease.backend
    try:
        async with asyncio.timeout(FILL_TIMEOUT_S), rt.session.post(
                backend.url + "/v1/completions", data=orjson.dumps(body),
                headers=UPSTREAM_HEADERS) as resp:
            answer = orjson.loads(await resp.read()) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        log.info("call %s: its engine %s gave no routes for the stream (%s)", ctx.id,
                 backend.id, type(exc).__name__)
        return False
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        return False  # refused or malformed: tells nothing of the engine
    field = choice.get("routed_experts")
    if not isinstance(field, str) or not field:
        if choice.get("finish_reason") != "abort":  # answered whole, without routes:
            backend.returns_routes = False  # a dense model, or an engine without the flag
        return False
    if not _same_weights(rt, ctx, version):
        return False  # weights changed while it ran
    backend.returns_routes = True
    ctx.capture.completion(0).routes.append([start, field])
    return True
