"""An engine's control routes: pause, abort, weight label, reload (vLLM's RL routes).

vLLM 0.32 registers these only when started with ``VLLM_SERVER_DEV_MODE=1``; the
simulated server has the same paths and answers (``backends/sim/pause.py``):

* ``POST /pause?mode=abort|wait|keep``, ``POST /resume``;
* ``POST /abort_requests {"request_ids": [...]}``: abort those requests (paused or not),
  each ending with ``finish_reason: "abort"`` and the tokens it had;
* ``POST /update_weight_version {"new_version"}``, ``GET /weight_info``: the label the
  engine attaches to every step it runs (``EngineCore._weight_version``, ``"default"``
  until set), i.e. what the engine itself says it serves;
* ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}``;
* ``POST /reset_prefix_cache?reset_running_requests=true``: ``{"success": bool}``; with
  the flag, requests frozen by ``keep`` are preempted and recomputed, so no KV computed
  with the old weights survives an update;
* ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter {"lora_name"}`` (vLLM started with ``--enable-lora`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): a request whose ``model`` is the name runs
  on the adapter; an unload forgets the name, requests running on it finish.

Each function answers ``None`` on success or a one-line reason; nothing raises.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

#: vLLM's label of an engine nobody told a version (``EngineCore._weight_version``)
UNLABELLED = "default"


async def control(session: aiohttp.ClientSession, url: str, method: str, path: str,
                  timeout_s: float, body: dict[str, Any] | None = None
                  ) -> tuple[str | None, Any]:
    """One control call: (None, the JSON answer or None) on a 2xx, else (why, None)."""
    try:
        async with session.request(method, url + path, json=body,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            data = await r.read()
            if r.status < 300:
                try:
                    return None, orjson.loads(data) if data else None
                except orjson.JSONDecodeError:
                    return None, None
            hint = (" (start vLLM with VLLM_SERVER_DEV_MODE=1 for its RL routes)"
                    if r.status == 404 else "")
            text = data[:300].decode(errors="replace")
            return f"{path} answered {r.status}{hint}: {text}", None
    except TimeoutError:
        return f"{path} did not answer within {timeout_s:.0f} s", None
    except aiohttp.ClientError as exc:
        return f"{path} failed: {exc}", None


async def call(session: aiohttp.ClientSession, url: str, method: str, path: str,
               timeout_s: float, body: dict[str, Any] | None = None) -> str | None:
    """A control call whose answer does not matter: None on a 2xx, else why it failed."""
    return (await control(session, url, method, path, timeout_s, body))[0]


async def abort_requests(session: aiohttp.ClientSession, url: str, ids: list[str],
                         timeout_s: float) -> str | None:
    """Abort the requests named ``ids`` (vLLM's external ids); unknown ids are ignored."""
    if not ids:
        return None
    return await call(session, url, "POST", "/abort_requests", timeout_s,
                      {"request_ids": ids})


async def weight_label(session: aiohttp.ClientSession, url: str, timeout_s: float
                       ) -> tuple[str | None, str | None]:
    """(the engine's own weight label, None) or (None, why it could not be read)."""
    error, answer = await control(session, url, "GET", "/weight_info", timeout_s)
    if error is not None:
        return None, error
    label = answer.get("weight_version") if isinstance(answer, dict) else None
    if not isinstance(label, str):
        return None, f"/weight_info answered without a weight_version: {answer!r:.200}"
    return label, None


async def label(session: aiohttp.ClientSession, url: str, version: str, timeout_s: float
                ) -> tuple[str | None, str | None]:
    """Tell the engine ``version``, then read back what it says it serves:
    (its label, None), or (its label or None, why it is not ``version``)."""
    error = await call(session, url, "POST", "/update_weight_version", timeout_s,
                       {"new_version": version})
    if error is not None:
        return None, error
    reported, error = await weight_label(session, url, timeout_s)
    if error is None and reported != version:
        error = f"/weight_info says {reported!r} after being told {version!r}"
    return reported, error


async def reload(session: aiohttp.ClientSession, url: str, weights_path: str | None,
                 timeout_s: float) -> str | None:
    """Reload the engine's weights from ``weights_path`` (its own model's path if None)."""
    body = {"method": "reload_weights",
            "kwargs": {"weights_path": weights_path} if weights_path else {}}
    return await call(session, url, "POST", "/collective_rpc", timeout_s, body)


async def reset_cache(session: aiohttp.ClientSession, url: str, timeout_s: float
                      ) -> str | None:
    """Drop every KV block computed with the old weights, frozen requests' included."""
    error, answer = await control(session, url, "POST",
                                  "/reset_prefix_cache?reset_running_requests=true",
                                  timeout_s)
    if error is None and isinstance(answer, dict) and answer.get("success") is False:
        return "/reset_prefix_cache answered success: false (KV blocks still held)"
    return error


async def load_adapter(session: aiohttp.ClientSession, url: str, name: str, path: str,
                       timeout_s: float) -> str | None:
    """Load the LoRA adapter at ``path`` as ``name``."""
    error, _ = await control(session, url, "POST", "/v1/load_lora_adapter", timeout_s,
                             {"lora_name": name, "lora_path": path})
    if error is not None and '"detail":"Not Found"' in error:  # no such route
        return ("/v1/load_lora_adapter is not served: start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    return error


async def unload_adapter(session: aiohttp.ClientSession, url: str, name: str,
                         timeout_s: float) -> str | None:
    """Unload the LoRA adapter ``name`` (an engine that does not hold it: done)."""
    error, _ = await control(session, url, "POST", "/v1/unload_lora_adapter", timeout_s,
                             {"lora_name": name})
    if error is not None and "cannot be found" in error:
        return None
    return error
