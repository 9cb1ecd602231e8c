"""OpenAI-compatible routes, plain and trajectory-scoped (``/t/{id}/v1``, ``/g/{g}/t/{id}/v1``).

Bodies are parsed by the proxy itself (one ``orjson.loads``) rather than by pydantic:
unknown and vendor fields must pass through untouched. The schemas below only document
the routes in the OpenAPI document.

The two completion routes (chat and text, all three URL forms) are answered by
:func:`serve_raw`, a raw ASGI path that :class:`gateway.app.GatewayApp` takes before
FastAPI's middleware, router and dependencies: they are the gateway's hot path, and that
stack cost about as much CPU per call as the relay itself. It does what the FastAPI route
does (the harness credential check, OpenAI's error shape, the body limit through the
proxy's own check); a path it does not match exactly, an id that fails the route's pattern
included, goes on to FastAPI, which answers it as before. The FastAPI routes stay registered for the
OpenAPI document.
"""

from __future__ import annotations

import re
import time
from typing import Any

from fastapi import APIRouter, Depends, Path, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.deps import Role, authorize, check_scope, get_proxy, get_rt, require_api_key
from gateway.api.errors import error_response
from gateway.errors import GatewayError
from gateway.proxy.relay import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Endpoint
from gateway.runtime import Runtime
from gateway.schema.ids import ID_PATTERN

ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]},
    }, "required": ["message", "type"]}},
    "required": ["error"],
}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": desc, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    for code, desc in [(400, "Malformed request"), (401, "Missing or invalid API key"),
                       (404, "Unknown model"), (413, "Body too large"),
                       (429, "Paused or overloaded"), (502, "Upstream failed"),
                       (503, "No backend available"), (504, "Upstream timed out")]
}
_MESSAGE = {"type": "object", "properties": {"role": {"type": "string"}}, "required": ["role"]}
CHAT_BODY = {
    "type": "object", "required": ["model", "messages"], "additionalProperties": True,
    "properties": {"model": {"type": "string", "minLength": 1},
                   "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                   "stream": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1},
                   "max_tokens": {"type": "integer", "minimum": 1},
                   "tools": {"type": "array", "items": {"type": "object"}}},
}
COMPLETION_BODY = {
    "type": "object", "required": ["model", "prompt"], "additionalProperties": True,
    "properties": {"model": {"type": "string", "minLength": 1},
                   "prompt": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                   "stream": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1},
                   "max_tokens": {"type": "integer", "minimum": 1}},
}


def _id_param() -> Any:
    """A fresh ``Path`` per parameter (FastAPI must not share one FieldInfo between two)."""
    return Path(pattern=f"^{ID_PATTERN.pattern}$", max_length=128)


router = APIRouter(dependencies=[Depends(require_api_key)], tags=["openai"])


def _doc(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _register(endpoint: Endpoint, schema: dict[str, Any]) -> None:
    suffix = endpoint.path
    opts: dict[str, Any] = {"responses": ERRORS, "openapi_extra": _doc(schema),
                            "response_class": Response}

    @router.post(suffix, name=f"{endpoint.name}", **opts)
    async def plain(request: Request) -> Response:
        return await get_proxy(request).handle(request, endpoint, path_traj=None,
                                               path_group=None)

    @router.post("/t/{trajectory_id}" + suffix, name=f"{endpoint.name}_t", **opts)
    async def scoped(request: Request, trajectory_id: str = _id_param()) -> Response:
        return await get_proxy(request).handle(request, endpoint, path_traj=trajectory_id,
                                               path_group=None)

    @router.post("/g/{group_id}/t/{trajectory_id}" + suffix, name=f"{endpoint.name}_gt",
                 **opts)
    async def grouped(
        request: Request, group_id: str = _id_param(), trajectory_id: str = _id_param()
    ) -> Response:
        return await get_proxy(request).handle(request, endpoint, path_traj=trajectory_id,
                                               path_group=group_id)


RESPONSES_BODY = {
    "type": "object", "required": ["model", "input"], "additionalProperties": True,
    "properties": {"model": {"type": "string", "minLength": 1},
                   "input": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                   "instructions": {"type": "string"},
                   "previous_response_id": {"type": "string"},
                   "stream": {"type": "boolean"},
                   "max_output_tokens": {"type": "integer", "minimum": 1},
                   "tools": {"type": "array", "items": {"type": "object"}}},
}
MESSAGES_BODY = {
    "type": "object", "required": ["model", "messages", "max_tokens"],
    "additionalProperties": True,
    "properties": {"model": {"type": "string", "minLength": 1},
                   "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                   "system": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                   "max_tokens": {"type": "integer", "minimum": 1},
                   "stream": {"type": "boolean"},
                   "tools": {"type": "array", "items": {"type": "object"}}},
}

_register(CHAT, CHAT_BODY)
_register(COMPLETIONS, COMPLETION_BODY)
_register(RESPONSES, RESPONSES_BODY)
_register(MESSAGES, MESSAGES_BODY)


def _models(rt: Runtime) -> dict[str, Any]:
    now = int(time.time())
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": now, "owned_by": "rollout-gateway"}
        for m in rt.registry.models()
    ]}


@router.get("/v1/models", name="models")
async def models(rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    return _models(rt)


@router.get("/t/{trajectory_id}/v1/models", name="models_t")
async def models_t(
    trajectory_id: str = _id_param(), rt: Runtime = Depends(get_rt)
) -> dict[str, Any]:
    return _models(rt)


@router.get("/g/{group_id}/t/{trajectory_id}/v1/models", name="models_gt")
async def models_gt(
    group_id: str = _id_param(), trajectory_id: str = _id_param(), rt: Runtime = Depends(get_rt)
) -> dict[str, Any]:
    return _models(rt)


_RAW_PATH = re.compile(
    rf"(?:/g/(?P<group>{ID_PATTERN.pattern})/t/(?P<gt>{ID_PATTERN.pattern})"
    rf"|/t/(?P<traj>{ID_PATTERN.pattern}))?"
    r"/v1/(?P<route>chat/completions|completions)")
_RAW_ENDPOINTS = {"chat/completions": CHAT, "completions": COMPLETIONS}


def raw_route(scope: Scope) -> tuple[Endpoint, str | None, str | None] | None:
    """(endpoint, trajectory id, group id) when :func:`serve_raw` answers this request."""
    if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
        return None
    m = _RAW_PATH.fullmatch(scope["path"])
    if m is None:
        return None
    return _RAW_ENDPOINTS[m["route"]], m["traj"] or m["gt"], m["group"]


async def serve_raw(scope: Scope, receive: Receive, send: Send) -> None:
    """The completion routes without FastAPI (see the module docstring); the match is
    ``scope["rg.route"]``, from :func:`raw_route`."""
    endpoint, traj, group = scope["rg.route"]
    request = Request(scope, receive)
    try:
        principal = authorize(request, Role.HARNESS)
        if principal.scope is not None:  # before the body is read
            check_scope(principal.scope, traj, group)
        await get_proxy(request).serve(request, send, endpoint, path_traj=traj,
                                       path_group=group)
    except GatewayError as exc:
        await error_response(request, exc)(scope, receive, send)
