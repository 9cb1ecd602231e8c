"""``POST /v1/messages/count_tokens``: the Messages API's token counter, from the engine.

Claude Code and the anthropic SDK ask it for a conversation's size before sending it. The
answer is the engine's own count for the prompt ``/v1/messages`` would run (the same
translation to chat, rendered by the engine's ``/tokenize`` with its chat template), so
it matches ``usage.input_tokens`` of that call. Nothing is recorded: no model call runs.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path, Request

from gateway.api.deps import get_proxy, get_rt, require_api_key
from gateway.errors import NoBackendAvailable, UpstreamError
from gateway.proxy.bodies import parse_door, read_body
from gateway.proxy.doors.messages import chat_messages
from gateway.proxy.relay import Proxy
from gateway.proxy.tokens import Tokenizer
from gateway.runtime import Runtime
from gateway.trajectories.tagging import validate_id

router = APIRouter(tags=["anthropic"], dependencies=[Depends(require_api_key)])
_SUFFIX = "/v1/messages/count_tokens"


async def prompt_tokens(rt: Runtime, proxy: Proxy, body: dict[str, Any],
                        messages: list[dict[str, Any]], tools: list[Any] | None) -> int:
    """How many tokens the engine would render ``messages`` (with ``tools``) into for
    ``body``'s model (aliases resolved), asked of one of its engines' ``/tokenize``."""
    proxy.resolve_alias(body)
    model = rt.adapters.base_of(body["model"]) or body["model"]  # a LoRA family's base
    rt.dispatcher.check_model(model)
    backends = rt.dispatcher.registry.routable(model)
    if not backends:
        raise NoBackendAvailable(f"no healthy backend serves {model!r} to count tokens")
    tok = Tokenizer(rt.session, backends[0].url, {"model": model, "tools": tools or None},
                    rt.settings.capture)
    ids = await tok(messages, generation=True)
    if ids is None:
        raise UpstreamError(tok.error or "the engine could not count the tokens")
    return len(ids)


async def _count(request: Request, rt: Runtime, proxy: Proxy) -> dict[str, Any]:
    server = rt.settings.server
    body = parse_door(await read_body(request, server.max_body_bytes),
                      max_depth=server.max_json_depth)
    messages, tools, _ = chat_messages(body, proxy.memory)
    return {"input_tokens": await prompt_tokens(rt, proxy, body, messages, tools)}


@router.post(_SUFFIX, name="count_tokens")
async def count_tokens(request: Request, rt: Runtime = Depends(get_rt),
                       proxy: Proxy = Depends(get_proxy)) -> dict[str, Any]:
    return await _count(request, rt, proxy)


@router.post("/t/{trajectory_id}" + _SUFFIX, name="count_tokens_t")
async def count_tokens_t(request: Request, trajectory_id: str = Path(max_length=128),
                         rt: Runtime = Depends(get_rt),
                         proxy: Proxy = Depends(get_proxy)) -> dict[str, Any]:
    validate_id(trajectory_id)
    return await _count(request, rt, proxy)


@router.post("/g/{group_id}/t/{trajectory_id}" + _SUFFIX, name="count_tokens_gt")
async def count_tokens_gt(request: Request, group_id: str = Path(max_length=128),
                          trajectory_id: str = Path(max_length=128),
                          rt: Runtime = Depends(get_rt),
                          proxy: Proxy = Depends(get_proxy)) -> dict[str, Any]:
    validate_id(group_id, what="group_id")
    validate_id(trajectory_id)
    return await _count(request, rt, proxy)
