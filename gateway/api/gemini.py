"""The Gemini API's routes: ``POST /v1beta/models/{model}:generateContent``,
``:streamGenerateContent`` and ``:countTokens`` (and the same under ``/v1``, where the
Python SDK asks), plain and trajectory-scoped (``/t/{id}``, ``/g/{g}/t/{id}``), as Gemini
CLI is pointed with ``GOOGLE_GEMINI_BASE_URL=GW/t/T``.

The first two are the Gemini door (:mod:`gateway.proxy.doors.gemini`), run by the proxy
like every other door. ``countTokens`` is the engine's count of the prompt
``generateContent`` would run (its ``/tokenize``, as ``/v1/messages/count_tokens``);
nothing is recorded. The key comes as ``x-goog-api-key`` (what the SDKs send), read by
the same credential check as every model route; errors are Google's envelope
(:mod:`gateway.api.errors` picks it by path).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Path, Request
from starlette.responses import Response

from gateway.api.count_tokens import prompt_tokens
from gateway.api.deps import get_proxy, get_rt, require_api_key
from gateway.proxy.bodies import read_body
from gateway.proxy.doors.gemini import parse_gemini
from gateway.proxy.doors.gemini_request import chat_prompt, field
from gateway.proxy.relay import GEMINI, GEMINI_STREAM, Endpoint, Proxy, RelayStream
from gateway.runtime import Runtime
from gateway.schema.ids import ID_PATTERN

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["gemini"])

ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "code": {"type": "integer"}, "message": {"type": "string"},
        "status": {"type": "string"}}, "required": ["code", "message", "status"]}},
    "required": ["error"],
}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": desc, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    for code, desc in [(400, "Malformed request"), (401, "Missing or invalid API key"),
                       (403, "A key for another trajectory"), (404, "Unknown model"),
                       (429, "Paused or overloaded"), (502, "Upstream failed"),
                       (503, "No backend available")]
}
GENERATE_BODY = {
    "type": "object", "required": ["contents"], "additionalProperties": True,
    "properties": {"contents": {"type": "array", "items": {"type": "object"}, "minItems": 1},
                   "systemInstruction": {"type": "object"},
                   "tools": {"type": "array", "items": {"type": "object"}},
                   "toolConfig": {"type": "object"},
                   "generationConfig": {"type": "object"}},
}
#: where the models' methods are: Gemini CLI and the JS SDK ask for v1beta, the Python
#: SDK (3.x) for v1; the two are one door here
VERSIONS = ("v1beta", "v1")


def _opts(schema: dict[str, Any]) -> dict[str, Any]:
    return {"responses": ERRORS, "response_class": Response,
            "openapi_extra": {"requestBody": {"required": True, "content": {
                "application/json": {"schema": schema}}}}}


def _id_param() -> Any:
    """A fresh ``Path`` per parameter (FastAPI must not share one FieldInfo between two)."""
    return Path(pattern=f"^{ID_PATTERN.pattern}$", max_length=128)


async def _generate(request: Request, endpoint: Endpoint) -> Response:
    params = request.path_params
    response = await get_proxy(request).handle(
        request, endpoint, path_traj=params.get("trajectory_id"),
        path_group=params.get("group_id"))
    if isinstance(response, RelayStream) and request.query_params.get("alt") != "sse":
        response.headers["content-type"] = "application/json"  # Google's JSON-array stream
    return response


async def _count(request: Request, rt: Runtime, proxy: Proxy) -> dict[str, Any]:
    server = rt.settings.server
    body = parse_gemini(await read_body(request, server.max_body_bytes),
                        request.path_params.get("model"), max_depth=server.max_json_depth)
    inner = field(body, "generateContentRequest")
    prompt = {**inner, "model": body["model"]} if isinstance(inner, dict) else body
    messages, tools, _ = chat_prompt(prompt, proxy.memory)
    return {"totalTokens": await prompt_tokens(rt, proxy, prompt, messages, tools)}


Handler = Callable[[Request], Awaitable[Any]]


def _routes(version: str, method: str, name: str, answer: Handler, **opts: Any) -> None:
    """``method``'s route under each prefix, answered by ``answer``."""
    suffix = f"/{version}/models/{{model:path}}:{method}"

    @router.post(suffix, name=name, **opts)
    async def plain(request: Request, model: str = Path()) -> Any:
        return await answer(request)

    @router.post("/t/{trajectory_id}" + suffix, name=f"{name}_t", **opts)
    async def scoped(request: Request, model: str = Path(),
                     trajectory_id: str = _id_param()) -> Any:
        return await answer(request)

    @router.post("/g/{group_id}/t/{trajectory_id}" + suffix, name=f"{name}_gt", **opts)
    async def grouped(request: Request, model: str = Path(), group_id: str = _id_param(),
                      trajectory_id: str = _id_param()) -> Any:
        return await answer(request)


async def _count_tokens(request: Request) -> dict[str, Any]:
    return await _count(request, get_rt(request), get_proxy(request))


for _v in VERSIONS:  # the OpenAPI document shows v1beta; v1 is the same door
    _shown = {"include_in_schema": _v == VERSIONS[0]}
    _routes(_v, "generateContent", f"gemini_generate_{_v}", lambda r: _generate(r, GEMINI),
            **_opts(GENERATE_BODY), **_shown)
    _routes(_v, "streamGenerateContent", f"gemini_stream_{_v}",
            lambda r: _generate(r, GEMINI_STREAM), **_opts(GENERATE_BODY), **_shown)
    _routes(_v, "countTokens", f"gemini_count_tokens_{_v}", _count_tokens, responses=ERRORS,
            **_shown)
