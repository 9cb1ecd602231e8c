"""One proxied call, end to end: validate, tag, dispatch, relay, capture, record.

Retries (before anything reached the client) are :func:`gateway.proxy.connect.connect`'s.

Cancellation: the upstream response is closed on every exit path, including a client
that disconnects while the call is queued, waiting for its first byte, or mid-stream, so
the engine stops generating and frees its KV cache. Admission: at most ``max_in_flight``
calls at once; more get 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.dispatch.backends import Backend, CircuitBreaker, backend_at_fault
from gateway.envelopes import openai_error_body
from gateway.errors import GatewayError, RecordingUnavailable, UpstreamError
from gateway.failure_log import refusals_logged
from gateway.proxy import routes
from gateway.proxy.admission import Admission
from gateway.proxy.aliases import resolve_model
from gateway.proxy.bodies import (
    openai_4xx_body,
    parse_request,
    read_body,
    upstream_message,
)
from gateway.proxy.calls import CallContext
from gateway.proxy.capture import Capture, inject
from gateway.proxy.connect import connect
from gateway.proxy.constraints import constraint_of
from gateway.proxy.continuation import (
    HoldingDecoder,
    continue_stream,
    continue_whole,
    should_continue,
    stream_head,
)
from gateway.proxy.doors import DoorStream, Translation
from gateway.proxy.doors.memory import ResponseMemory
from gateway.proxy.doors.open import open_door
from gateway.proxy.lifecycle import CLIENT_LEFT, Call, abandon, arrive
from gateway.proxy.sse import error_event
from gateway.proxy.tokens import PromptPlanner
from gateway.proxy.upstream import UpstreamResponse
from gateway.runtime import Runtime
from gateway.trajectories.branches import digest_messages
from gateway.trajectories.tagging import identify, prompt_identity
from gateway.trajectories.tools import parse_outcomes

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    path: str
    chat: bool
    door: str | None = None  # a front door translated to chat completions upstream

    @property
    def upstream(self) -> str:
        return CHAT.path if self.door else self.path


CHAT = Endpoint("chat", "/v1/chat/completions", chat=True)
COMPLETIONS = Endpoint("completions", "/v1/completions", chat=False)
RESPONSES = Endpoint("responses", "/v1/responses", chat=True, door="responses")
MESSAGES = Endpoint("messages", "/v1/messages", chat=True, door="messages")
GEMINI = Endpoint("gemini", "/v1beta/models/{model:path}:generateContent", chat=True,
                  door="gemini")
GEMINI_STREAM = Endpoint("gemini", "/v1beta/models/{model:path}:streamGenerateContent",
                         chat=True, door="gemini_stream")


async def _watch_disconnect(receive: Receive, handler: asyncio.Task[Any]) -> None:
    """Cancel ``handler`` when the client disconnects (the body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    handler.cancel(CLIENT_LEFT)


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work`` in this task; cancel it (closing its upstream call) if the client
    goes away first. One watcher task per call, not a second task for the work."""
    response = await _unless_disconnected_do(request.receive, work)
    return Response(status_code=499) if response is None else response


async def _unless_disconnected_do(receive: Receive, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None if the client disconnected first (``work`` is then
    cancelled where it waits, which closes its upstream call)."""
    handler = asyncio.current_task()
    assert handler is not None
    watcher = asyncio.ensure_future(_watch_disconnect(receive, handler))
    try:
        return await work
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise  # cancelled from outside (server shutdown): not ours to swallow
        handler.uncancel()
        return None
    finally:
        watcher.cancel()


def _render_context(body: dict[str, Any]) -> Any:
    """What besides the messages shapes the engine's rendering of a chat request."""
    return [body.get("tools"), body.get("chat_template_kwargs"), body.get("chat_template")]


class RelayStream(StreamingResponse):
    """A streamed relay whose clean-up runs however the response ends.

    It sends its chunks itself rather than through Starlette's ``StreamingResponse``
    machinery (a task group of two tasks per call): the one disconnect watcher per call
    cancels the sending task when the client goes away. It owns its call (handed off to it)
    and ``relay`` closes the upstream and ends the call, including when the client left
    before the first chunk (the generator, never started, ran none of its own clean-up).
    """

    def __init__(self, content: AsyncGenerator[bytes, None], call: Call,
                 upstream: UpstreamResponse, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._gen = content
        self._call = call.hand_off()
        self._upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _unless_disconnected_do(receive, self.relay(send))

    async def relay(self, send: Send) -> None:
        """Send the response (its caller watches for a disconnect), then clean up."""
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self._gen:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with contextlib.suppress(RuntimeError):  # already running elsewhere: it closes
                await self._gen.aclose()
            self._upstream.close()
            self._call.end(error=asyncio.CancelledError(CLIENT_LEFT))  # unless it ended


class Proxy:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.breaker = CircuitBreaker(rt.settings.upstream)
        server = rt.settings.server
        self.admission = Admission(server.max_in_flight, server.overload_retry_after_s)
        rt.writer.calls_in_flight = lambda: self.admission.active
        self.memory = ResponseMemory(server.response_store_size, server.response_store_ttl_s)
        self.planner = PromptPlanner(rt.session, rt.settings.capture)
        rt.metrics.add_collector(self.admission.collect)

    async def handle(
        self, request: Request, endpoint: Endpoint, *, path_traj: str | None, path_group: str | None
    ) -> Response:
        """A call through the FastAPI routes (the front doors): the response to send."""
        with refusals_logged(self.rt.failure_log, endpoint.name, path_traj, request.headers):
            call = await self._admit(request, endpoint, path_traj, path_group)
        with call:
            return await _unless_disconnected(request, self._run(call, endpoint))

    async def serve(self, request: Request, send: Send, endpoint: Endpoint, *,
                    path_traj: str | None, path_group: str | None) -> None:
        """A call through the raw ASGI route (``gateway.api.openai.serve_raw``): the
        upstream call and the relay of its answer run under one disconnect watcher. A
        :class:`GatewayError` raised before the answer starts is the caller's to send."""
        with refusals_logged(self.rt.failure_log, endpoint.name, path_traj, request.headers):
            call = await self._admit(request, endpoint, path_traj, path_group)
        with call:
            await _unless_disconnected_do(request.receive,
                                          self._answer(call, endpoint, request, send))

    async def _answer(self, call: Call, endpoint: Endpoint,
                      request: Request, send: Send) -> None:
        response = await self._run(call, endpoint)
        if isinstance(response, RelayStream):
            await response.relay(send)
            return
        await response(request.scope, request.receive, send)

    async def _admit(self, request: Request, endpoint: Endpoint, path_traj: str | None,
                     path_group: str | None) -> Call:
        """An admission slot, then the call's context: the call, which owns both and
        releases the slot when it ends. Refused while the gateway could not record the
        call (:attr:`TraceWriter.refusal`)."""
        if (why := self.rt.writer.refusal) is not None:
            raise RecordingUnavailable(
                why, retry_after_s=self.rt.settings.traces.retry_backoff_max_s)
        slot = self.admission.enter()
        try:
            ctx = await self._prepare(request, endpoint, path_traj, path_group)
        except BaseException:
            slot.release()
            raise
        return Call(self.rt, ctx, slot)

    async def _prepare(self, request: Request, endpoint: Endpoint, path_traj: str | None,
                       path_group: str | None) -> CallContext:
        """Read, check and tag the call: the context it runs with."""
        arrived = time.monotonic()
        server = self.rt.settings.server
        raw = await read_body(request, server.max_body_bytes)
        door: Translation | None = None
        if endpoint.door is None:
            body = client_body = parse_request(raw, chat=endpoint.chat,
                                               max_depth=server.max_json_depth)
        else:
            client_body, door = open_door(
                endpoint.door, raw, self.memory, max_depth=server.max_json_depth,
                path_model=request.path_params.get("model"),
                alt=request.query_params.get("alt"))
            body = door.chat_body
        ident = identify(
            path_trajectory=path_traj, path_group=path_group, headers=request.headers,
            body=client_body, api_keys_enabled=self.rt.settings.auth_enabled,
        )
        requested = self.resolve_alias(body)
        model = body["model"]
        # a LoRA family is asked of its base's engines (bound to its adapter at dispatch)
        body["model"] = served = self.rt.adapters.base_of(model) or model
        self.rt.dispatcher.check_model(served)
        if not ident.generated and self.rt.tracker.get(ident.trajectory_id) is None:
            await self.rt.restorer.restore(ident.trajectory_id)  # after a restart
        state = self.rt.tracker.touch(ident.trajectory_id, ident.group_id, time.time())
        if state.prompt_id is None:
            self.rt.tracker.describe(state, prompt_id=prompt_identity(body),
                                     model=served, auto=ident.generated)
        outcomes = parse_outcomes(body["messages"]) if endpoint.chat else []
        if door is not None:
            outcomes = door.adjust_outcomes(outcomes)
        seq = arrive(self.rt, state, outcomes, model)
        try:
            ctx = CallContext(
                id=uuid.uuid4().hex, endpoint=endpoint.name, state=state, body=body,
                seq=seq,
                stream=body.get("stream") is True, arrived=arrived, started_wall=time.time(),
                capture=Capture(chat=endpoint.chat, asked=inject(body, chat=endpoint.chat)),
                headers={"x-trajectory-id": ident.trajectory_id}, door=door,
                requested_model=requested, size=len(raw), constrained=constraint_of(body),
                model=model, served=served,
            )
            if ctx.capture.asked.routes:  # the client's own routed_experts_prompt_start
                ctx.capture.routes_start = routes.ask(body, 0, client_chose=True)
            if endpoint.chat:
                ctx.digests = digest_messages(body["messages"], _render_context(body))
                ctx.continues = state.tree.continuation(ctx.digests, body["messages"])
        except BaseException:
            abandon(self.rt, state)
            raise
        return ctx

    def resolve_alias(self, body: dict[str, Any]) -> str | None:
        """Map the client's model name to a served one (``model_aliases``); the name
        the client asked for when it was changed."""
        aliases = self.rt.settings.model_aliases
        asked = body.get("model")
        if not aliases or not isinstance(asked, str):
            return None
        dispatcher = self.rt.dispatcher
        served = dispatcher.registry.known_models() | self.rt.adapters.families.keys()
        if dispatcher.capacity is not None:
            served |= dispatcher.capacity.served_models()
        body["model"] = resolve_model(aliases, asked, served)
        return asked if body["model"] != asked else None

    async def _run(self, call: Call, endpoint: Endpoint) -> Response:
        """The call's response; a failure to reach any backend leaves to ``call``'s
        scope, which ends the call with it."""
        ctx = call.ctx
        upstream = await connect(self.rt, self.breaker, ctx, endpoint.upstream,
                                 self.planner if endpoint.chat else None)
        if upstream.status != 200:
            return await self._relay_error(call, upstream)
        if ctx.stream:
            return RelayStream(self._stream(call, upstream), call, upstream,
                               headers={**ctx.headers, "cache-control": "no-cache"})
        return await self._relay_whole(call, upstream)

    async def _relay_error(self, call: Call, upstream: UpstreamResponse) -> Response:
        ctx = call.ctx
        try:
            data = await upstream.read()
        finally:
            upstream.close()
        status = upstream.status if upstream.status < 500 else 502
        said = upstream_message(data)
        error = UpstreamError(f"upstream answered {upstream.status}: "
                              f"{said or data[:300].decode(errors='replace')}")
        error.status_code = status  # what the client is answered
        call.end(error=error, backend_ok=not backend_at_fault(upstream.status))
        if ctx.door is not None:  # the engine's message, in the door's error shape
            error.message = said or error.message
            data = ctx.door.error_body(error)
        elif status < 500:  # the engine's message, in OpenAI's shape (vLLM's differs)
            data = openai_4xx_body(data, status)
        else:  # never the engine's own body, whatever it is: the gateway's 502
            data = openai_error_body(error.message, error_type=error.error_type,
                                     code=error.code)
        return Response(data, status_code=status, media_type="application/json",
                        headers=ctx.headers)

    def _broke(self, backend: Backend, exc: GatewayError) -> None:
        """The backend failed mid-response (died, hung): count it against the backend."""
        self.breaker.failure(backend, exc.message)

    async def _relay_whole(self, call: Call, upstream: UpstreamResponse) -> Response:
        ctx = call.ctx
        try:
            data = await upstream.read()
            ctx.first_byte = time.monotonic()
            payload = orjson.loads(data)
            if ctx.capture.feed(payload, stream=False):
                data = orjson.dumps(payload)
            if should_continue(self.rt, ctx):
                await continue_whole(self.rt, ctx, payload)
                data = orjson.dumps(payload)
            if ctx.door is not None:
                data = ctx.door.whole(payload)
        except BaseException as exc:
            upstream.close()
            call.end(error=exc)
            if isinstance(exc, UpstreamError) and ctx.lease is not None:
                self._broke(ctx.lease.backend, exc)
            if isinstance(exc, orjson.JSONDecodeError):
                raise UpstreamError("upstream answered with invalid JSON") from None
            raise
        upstream.close()
        call.end()
        return Response(data, media_type="application/json", headers=ctx.headers)

    async def _stream(self, call: Call, upstream: UpstreamResponse
                      ) -> AsyncGenerator[bytes, None]:
        ctx = call.ctx
        decoder = HoldingDecoder(self.rt, ctx)
        door = DoorStream(ctx.door) if ctx.door is not None else None
        error: BaseException | None = None
        try:
            async for chunk in upstream.chunks():
                out = decoder.feed(chunk)
                if door is not None and out:
                    out = door.feed(out)
                if out:
                    if ctx.first_byte is None:
                        ctx.first_byte = time.monotonic()
                    yield out
            tail = decoder.flush()
            if door is not None and tail:
                tail = door.feed(tail) + door.flush()
            if tail:
                yield tail
            if decoder.held:  # the engine aborted it for a weight update: finish it
                upstream.close()
                async for out in continue_stream(self.rt, ctx,
                                                 decoder.head or stream_head(ctx, None)):
                    if door is not None:
                        out = door.feed(out)
                    if out:
                        yield out
            if routes.wants_fill(ctx):  # before the response ends: the record is whole
                ctx.generated_at = time.monotonic()
                upstream.close()
                await routes.fill(self.rt, ctx)
        except GatewayError as exc:
            error = exc
            if ctx.lease is not None:
                self._broke(ctx.lease.backend, exc)
            yield error_event(exc) if ctx.door is None else ctx.door.error_event(exc)
        except BaseException as exc:  # client went away (cancelled) or a bug: record it
            # a client that leaves once it has the finish (before the engine's stream
            # ends) got every token: the call is whole, and ok for training
            whole = (isinstance(exc, asyncio.CancelledError | GeneratorExit)
                     and not decoder.held and ctx.capture.generated_all())
            error = None if whole else exc
            raise
        finally:
            upstream.close()
            call.end(error=error)

