"""One instance of a managed pool, as the pool manager tracks it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from backends.base import InstanceSpec, LaunchedInstance, ServerState
from gateway.dispatch.backends import Backend
from gateway.pool.checkpoint import Weights

log = logging.getLogger(__name__)
WARMUP_TIMEOUT_S = 120.0


@dataclass(slots=True)
class PoolInstance:
    """A spec, its lifecycle state, and (once started) the server and its registry entry.

    The registry's ``Backend.state`` mirrors ``state`` so that placement sees draining
    and failed instances as not routable.
    """

    spec: InstanceSpec
    state: ServerState = ServerState.STARTING
    launched: LaunchedInstance | None = None
    backend: Backend | None = None
    restarts: int = 0
    error: str | None = None
    start_s: float | None = None
    since: float = field(default_factory=time.time)
    #: the weights it was started on or last updated to
    weights: Weights | None = None
    #: the version it waits for (the trainer pushed it; no path holds it), not admitted
    awaiting: str | None = None

    def set_state(self, state: ServerState) -> None:
        self.state, self.since = state, time.time()
        if self.backend is not None:
            self.backend.state = state
            if state is ServerState.FAILED:
                self.backend.healthy = False

    def to_dict(self) -> dict[str, Any]:
        b = self.backend
        return {
            "id": self.spec.id, "state": self.state.value, "tp": self.spec.tp,
            "gpus": list(self.spec.gpus), "node": self.spec.node,
            "url": self.launched.url if self.launched else None,
            "in_flight": b.in_flight if b else 0, "healthy": b.healthy if b else False,
            "restarts": self.restarts, "error": self.error, "start_s": self.start_s,
            "since": self.since,
            "log_path": self.launched.log_path if self.launched else None,
            "weight_version": b.weight_version if b else None,
            "weights_path": self.weights.path if self.weights else None,
            "awaiting_weights": self.awaiting,
        }


async def warm_up(session: aiohttp.ClientSession, url: str, model: str) -> None:
    """One ``max_tokens: 1`` call: a real vLLM's first call is seconds slower."""
    body = {"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "warm-up"}]}
    timeout = aiohttp.ClientTimeout(total=WARMUP_TIMEOUT_S)
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                timeout=timeout) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("warm-up call to %s failed: %s", url, exc)
