"""vLLM's RL control routes on the simulated server: pause, resume, weight version.

Same paths and answers as vLLM 0.32 started with ``VLLM_SERVER_DEV_MODE=1``:

* ``POST /pause?mode=abort|wait|keep``: ``abort`` finishes every in-flight request now
  with ``finish_reason: "abort"`` and the tokens it had (its client gets a normal answer
  or the rest of its stream); ``wait`` returns once in-flight requests have finished;
  ``keep`` freezes them where they are. In every mode the engine then stops stepping:
  requests that arrive while paused queue until ``POST /resume``. Like vLLM, the answer
  comes once the tokens of the steps already run have gone out.
* ``POST /abort_requests`` ``{"request_ids": [...]}``: abort those requests (ids as vLLM
  names them: ``chatcmpl-<request_id>``, ``cmpl-<request_id>``), paused or not; empty:
  all of them.
* ``GET /is_paused`` -> ``{"is_paused": bool}``.
* ``POST /update_weight_version`` ``{"new_version": "..."}`` and ``GET /weight_info``
  -> ``{"weight_version": "..."}`` (``"default"`` until set, as vLLM).
* ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path"}}``:
  the simulator has no weights; it records the path it "loaded" (``/sim/stats``
  ``weights_path``) and fails as vLLM does when the path does not exist.
  ``POST /reset_prefix_cache`` answers ``{"success": true}`` (the simulated cache is
  left alone: its tokens do not depend on weights).

Every request records, as vLLM's output processor does, which weight version made each
of its delivered tokens (``/sim/stats`` ``requests_seen[].weight_spans``): the truth a
test compares the gateway's per-token versions with.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from backends.sim.protocol import APIError, json_object, json_response
from backends.sim.state import sim_of

router = APIRouter()
PAUSE_MODES = ("abort", "wait", "keep")


@router.post("/pause")
async def pause(request: Request, mode: str = "abort") -> Response:
    if mode not in PAUSE_MODES:
        raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}", param="mode")
    sim = sim_of(request)
    engine = sim.engine
    if mode == "wait":
        await engine.drained()
        engine.pause()
    else:
        engine.pause()
        await engine.settled()
        if mode == "abort":
            sim.num_pause_aborts += engine.abort_in_flight()
    sim.num_pauses += 1
    return json_response({"status": "paused"})


@router.post("/abort_requests")
async def abort_requests(request: Request) -> Response:
    ids = (await json_object(request)).get("request_ids")
    if ids is not None and (not isinstance(ids, list)
                            or not all(isinstance(i, str) for i in ids)):
        raise APIError(400, "'request_ids' must be a list of strings", param="request_ids")
    engine = sim_of(request).engine
    n = engine.abort_ids(set(ids)) if ids else engine.abort_in_flight()
    return json_response({"status": "aborted", "aborted": n})


@router.post("/resume")
async def resume(request: Request) -> Response:
    sim_of(request).engine.resume()
    return json_response({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> Response:
    return json_response({"is_paused": sim_of(request).engine.paused})


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    version = (await json_object(request)).get("new_version")
    if not isinstance(version, str):
        raise APIError(400, "'new_version' must be a string", param="new_version")
    sim_of(request).weight_version = version
    return json_response({"success": True, "new_version": version})


@router.get("/weight_info")
async def weight_info(request: Request) -> Response:
    return json_response({"weight_version": sim_of(request).weight_version})


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> Response:
    body = await json_object(request)
    if body.get("method") != "reload_weights":
        raise APIError(400, "the simulated server only supports method 'reload_weights'",
                       param="method")
    kwargs = body.get("kwargs") or {}
    path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
    sim = sim_of(request)
    if isinstance(path, str):
        if not await asyncio.to_thread(os.path.isdir, path):
            raise APIError(500, f"reload_weights failed: no checkpoint at {path!r}")
        sim.weights_path = path
    sim.num_reloads += 1
    return json_response({"results": [None]})


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    """Accepted; the simulated prefix cache is left as it is (its tokens do not depend on
    weights)."""
    sim_of(request)
    return json_response({"success": True})
