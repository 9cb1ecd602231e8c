"""vLLM's RL control routes on the simulated server: pause, resume, weight version.

Same paths and answers as vLLM 0.32 started with ``VLLM_SERVER_DEV_MODE=1``:

* ``POST /pause?mode=abort|wait|keep``: ``abort`` finishes every in-flight request now
  with ``finish_reason: "abort"`` and the tokens it had (its client gets a normal answer
  or the rest of its stream); ``wait`` returns once in-flight requests have finished;
  ``keep`` freezes them where they are. In every mode the engine then stops stepping:
  requests that arrive while paused queue until ``POST /resume``.
* ``GET /is_paused`` -> ``{"is_paused": bool}``.
* ``POST /update_weight_version`` ``{"new_version": "..."}`` and ``GET /weight_info``
  -> ``{"weight_version": "..."}``.
* ``POST /collective_rpc`` ``{"method": "reload_weights", ...}`` and
  ``POST /reset_prefix_cache`` are accepted as no-ops (the simulator has no weights), so
  an orchestrated update can run against it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from backends.sim.protocol import APIError, json_response
from backends.sim.state import SimState

router = APIRouter()
PAUSE_MODES = ("abort", "wait", "keep")


def _sim(request: Request) -> SimState:
    state: SimState = request.state.sim
    return state


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


@router.post("/pause")
async def pause(request: Request, mode: str = "abort") -> Response:
    if mode not in PAUSE_MODES:
        raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}", param="mode")
    sim = _sim(request)
    engine = sim.engine
    if mode == "wait":
        await engine.drained()
        engine.pause()
    else:
        engine.pause()
        if mode == "abort":
            sim.num_pause_aborts += engine.abort_in_flight()
    sim.num_pauses += 1
    return json_response({"status": "paused"})


@router.post("/resume")
async def resume(request: Request) -> Response:
    _sim(request).engine.resume()
    return json_response({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> Response:
    return json_response({"is_paused": _sim(request).engine.paused})


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    version = (await _json(request)).get("new_version")
    if not isinstance(version, str):
        raise APIError(400, "'new_version' must be a string", param="new_version")
    _sim(request).weight_version = version
    return json_response({"success": True, "new_version": version})


@router.get("/weight_info")
async def weight_info(request: Request) -> Response:
    return json_response({"weight_version": _sim(request).weight_version})


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> Response:
    body = await _json(request)
    if body.get("method") != "reload_weights":
        raise APIError(400, "the simulated server only supports method 'reload_weights'",
                       param="method")
    _sim(request).num_reloads += 1
    return json_response({"results": [None]})


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    """Accepted; the simulated prefix cache is left as it is (its tokens do not change)."""
    _sim(request)
    return Response(status_code=200)
