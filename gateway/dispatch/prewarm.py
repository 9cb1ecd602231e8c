"""Execution of policy decisions that touch backends: migration prewarms.

A gateway cannot move KV cache between engines, so a migration decided during a tool gap
is executed by warming the target's prefix cache: the trajectory's exact token context
is sent as a ``/v1/completions`` prompt of token ids with ``max_tokens: 1`` while the
tool runs; the trajectory's next call is then placed on the target and hits the cache.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from gateway.dispatch.backends import Backend

log = logging.getLogger(__name__)
PREWARM_TIMEOUT_S = 60.0


async def prewarm(session: aiohttp.ClientSession, backend: Backend, model: str,
                  token_ids: list[int]) -> bool:
    """Prefill ``token_ids`` on ``backend`` (one generated token); False if it failed."""
    body = orjson.dumps({"model": model, "prompt": token_ids, "max_tokens": 1,
                         "temperature": 0.0})
    try:
        async with asyncio.timeout(PREWARM_TIMEOUT_S), session.post(
                f"{backend.url}/v1/completions", data=body,
                headers={"content-type": "application/json"}) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.info("prewarm on %s failed: %s", backend.id, exc)
        return False
