"""The simulated vLLM server: an OpenAI-compatible FastAPI app over a simulated engine.

``create_sim_app(config)`` builds the app; its lifespan owns the engine loop, so nothing
runs at import and several servers can live in one process (``runner.py``). Behaviour
follows vLLM's OpenAI server where the gateway depends on it: ``return_token_ids``
(top-level ``prompt_token_ids``, per-choice ``token_ids``; in streams the first chunk
carries the prompt ids and every chunk the ids it adds), chat-style logprobs, ``priority``,
``ignore_eos``, ``stop``, ``n``, ``stream_options.include_usage``, hermes tool calls,
404/400 in OpenAI's error envelope, and abort on client disconnect (the request leaves the
batch and frees its KV blocks; ``/sim/stats`` counts it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from backends.sim.chat import ToolCall, choose_tool_call, plan_completion, render_chat
from backends.sim.lora import router as lora_router
from backends.sim.pause import router as pause_router
from backends.sim.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    json_response,
    parse_body,
)
from backends.sim.responses import Choice, ResponseShape, merged_deltas
from backends.sim.state import SimServerConfig, SimState, sim_of
from backends.sim.tokenizer import IM_END

router = APIRouter()


class _EngineStream(StreamingResponse):
    """SSE response that notices a client disconnect while it waits for tokens and always
    runs ``on_close`` (which aborts unfinished requests upstream)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            self._on_close()

    async def _stream(self, send: Send) -> None:
        with contextlib.suppress(OSError):
            await self.stream_response(send)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _finish_or_abort(request: Request, sim: SimState, choices: list[Choice]) -> bool:
    """Wait until every choice finished; on client disconnect abort them (False)."""
    async def drain() -> None:
        async for _ in merged_deltas(choices):
            pass

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    if work.done() and not work.cancelled() and work.exception() is None:
        return True
    sim.abort_all(choices)
    return False


async def _respond(request: Request, sim: SimState, shape: ResponseShape,
                   choices: list[Choice], stream: bool, include_usage: bool) -> Response:
    if not stream:
        if not await _finish_or_abort(request, sim, choices):
            return Response(status_code=499)
        return json_response(shape.full_response(choices))

    async def events() -> AsyncIterator[bytes]:
        for c in choices:
            yield shape.first_chunk(c)
        async for c, delta in merged_deltas(choices):
            if c.aborted and c.sent == 0 and delta.num_new == 0:
                continue  # as vLLM: no chunk for a request aborted before its first token
            yield shape.delta_chunk(c, delta)
        if include_usage:
            yield shape.usage_chunk(choices)
        yield b"data: [DONE]\n\n"

    return _EngineStream(events(), on_close=lambda: sim.abort_all(choices))


def _tool_choice(sim: SimState, body: ChatBody) -> tuple[Any, ToolCall | None]:
    """``tool_choice``, or the scripted one for this turn when a tool script is set; and
    the scripted call itself when the script names one the request offers."""
    script = sim.config.tool_script
    if script is None or body.tool_choice == "none" or isinstance(body.tool_choice, dict):
        return body.tool_choice, None
    turn = sum(1 for m in body.messages if isinstance(m, dict) and m.get("role") == "assistant")
    step = script[turn] if turn < len(script) else False
    if not step:
        return "none", None
    offered = {(t.get("function") or {}).get("name") for t in body.tools or ()
               if isinstance(t, dict)}
    calls = step if isinstance(step, tuple) else (step,) if isinstance(step, ToolCall) else ()
    return "required", next((c for c in calls if c.name in offered), None)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    sim = sim_of(request)
    body = await parse_body(request, ChatBody)
    sim.check_model(body.model)
    prompt_ids = _given_prompt(sim, body.kv_transfer_params)
    if prompt_ids is None:
        try:
            prompt_ids = sim.tok.encode(render_chat(body.messages, body.tools))
        except (ValueError, TypeError, AttributeError) as exc:
            raise APIError(400, f"invalid messages: {exc}", param="messages") from None
    max_tokens = sim.resolve_max_tokens(len(prompt_ids),
                                        body.max_completion_tokens or body.max_tokens)
    routes = sim.route_ask(body.routed_experts_prompt_start, len(prompt_ids), body.model)
    choices = []
    for i in range(body.n):
        rng, seed = sim.rng_for(body.seed, i, sim.adapter_of(body.model))
        choice, scripted = _tool_choice(sim, body)
        call = scripted or choose_tool_call(body.tools or [], choice, rng, sim.tok,
                                            sim.config.tool_call_prob)
        length = sim.draw_length(rng)
        if call is not None and sim.config.tool_script is not None:
            length = 0  # a scripted tool turn is the call alone: no words before it
        comp = plan_completion(sim.tok, rng, natural_len=length,
                               max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                               tool_call=call, stop=body.stop_list)
        choices.append(Choice.plan(sim.tok, i, comp, seed))
    rid = sim.new_id("chatcmpl", body.request_id)
    shape = ResponseShape(sim.tok, rid, body.model, prompt_ids,
                          chat=True, logprobs=body.logprobs,
                          top_logprobs=body.top_logprobs or 0,
                          return_token_ids=body.return_token_ids,
                          routes=None if body.stream else routes)
    sim.record_seen(shape.rid, body, len(prompt_ids), max_tokens)
    await sim.submit(shape.rid, prompt_ids, choices, body.priority, sim.adapter_of(body.model))
    return await _respond(request, sim, shape, choices, body.stream, body.include_usage)


def _given_prompt(sim: SimState, params: dict[str, Any] | None) -> list[int] | None:
    """``kv_transfer_params.prompt_token_ids`` checked as vLLM checks it, or None."""
    ids = (params or {}).pop("prompt_token_ids", None)
    if ids is None:
        return None
    vocab = sim.tok.vocab_size
    if not isinstance(ids, list) or not ids or any(
            type(x) is not int or not 0 <= x < vocab for x in ids):
        raise APIError(400, "`kv_transfer_params['prompt_token_ids']` must be a non-empty "
                       "list of token ids in the vocabulary",
                       param="kv_transfer_params.prompt_token_ids")
    return ids


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """vLLM's tokenizer route: the ids the engine would run for a chat or a prompt."""
    sim = sim_of(request)
    body = await parse_body(request, TokenizeBody)
    if body.model is not None:
        sim.check_model(body.model)
    if body.messages is not None:
        try:
            text = render_chat(body.messages, body.tools,
                               add_generation_prompt=body.add_generation_prompt
                               and not body.continue_final_message)
        except (ValueError, TypeError, AttributeError) as exc:
            raise APIError(400, f"invalid messages: {exc}", param="messages") from None
        if body.continue_final_message and text.endswith(f"{IM_END}\n"):
            text = text[:-len(IM_END) - 1]
    elif body.prompt is not None:
        text = body.prompt
    else:
        raise APIError(400, "either 'messages' or 'prompt' is required", param="messages")
    ids = sim.tok.encode(text)
    return json_response({"count": len(ids), "max_model_len": sim.config.context_len,
                          "tokens": ids, "token_strs": None})


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """vLLM's ``/detokenize``: the text of a list of ids (special tokens included)."""
    sim = sim_of(request)
    body = await parse_body(request, DetokenizeBody)
    if body.model is not None:
        sim.check_model(body.model)
    vocab = sim.tok.vocab_size
    bad = next((x for x in body.tokens if not 0 <= x < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of vocabulary (size {vocab})",
                       param="tokens")
    return json_response({"prompt": sim.tok.decode(body.tokens)})


def _completion_prompts(sim: SimState, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [sim.tok.encode(prompt)]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return [sim.tok.encode(p) if isinstance(p, str) else list(p) for p in prompt]


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    sim = sim_of(request)
    body = await parse_body(request, CompletionBody)
    sim.check_model(body.model)
    prompts = _completion_prompts(sim, body.prompt)
    if len(prompts) != 1:
        raise APIError(400, "the simulated server accepts one prompt per request",
                       param="prompt")
    prompt_ids = prompts[0]
    if not prompt_ids:
        raise APIError(400, "prompt must not be empty", param="prompt")
    max_tokens = sim.resolve_max_tokens(len(prompt_ids), body.max_tokens)
    routes = sim.route_ask(body.routed_experts_prompt_start, len(prompt_ids), body.model)
    choices = []
    for i in range(body.n):
        rng, seed = sim.rng_for(body.seed, i, sim.adapter_of(body.model))
        comp = plan_completion(sim.tok, rng, natural_len=sim.draw_length(rng),
                               max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                               stop=body.stop_list)
        choices.append(Choice.plan(sim.tok, i, comp, seed))
    rid = sim.new_id("cmpl", body.request_id)
    shape = ResponseShape(sim.tok, rid, body.model, prompt_ids,
                          chat=False, logprobs=body.logprobs is not None,
                          top_logprobs=body.logprobs or 0,
                          return_token_ids=body.return_token_ids,
                          routes=None if body.stream else routes)
    sim.record_seen(shape.rid, body, len(prompt_ids), max_tokens)
    await sim.submit(shape.rid, prompt_ids, choices, body.priority, sim.adapter_of(body.model))
    return await _respond(request, sim, shape, choices, body.stream, body.include_usage)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    sim = sim_of(request)
    card = {"id": sim.config.served_name, "object": "model", "created": 0,
            "owned_by": "rollout-gateway-sim", "root": sim.config.served_name,
            "max_model_len": sim.config.context_len}
    adapters = [{"id": a.name, "object": "model", "created": 0,
                 "owned_by": "rollout-gateway-sim", "root": a.path,
                 "parent": sim.config.served_name} for a in sim.adapters.values()]
    return json_response({"object": "list", "data": [card, *adapters]})


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    data = generate_latest(sim_of(request).metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)


@router.get("/sim/stats")
async def sim_stats(request: Request) -> Response:
    return json_response(sim_of(request).stats())


def create_sim_app(config: SimServerConfig | None = None) -> FastAPI:
    """A simulated vLLM server; the engine loop lives as long as the app's lifespan."""
    cfg = config or SimServerConfig()
    cfg.profile()  # fail fast on an unknown profile, before any server starts

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        sim = SimState(cfg)
        task = asyncio.create_task(sim.engine.run(), name=f"sim-engine-{cfg.served_name}")
        try:
            yield {"sim": sim}
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="rollout-gateway simulated vLLM", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.include_router(router)
    app.include_router(pause_router)
    if cfg.enable_lora:
        app.include_router(lora_router)

    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    app.add_exception_handler(APIError, api_error)
    return app
