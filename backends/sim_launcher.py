"""The pool's simulated-server launcher: :mod:`backends.sim.launcher` with the pool
spec's knobs, and a way to crash an instance.

The pool spec names a latency *profile* (``qwen3-14b`` on ``H100``) separately from
the model name clients send, so a simulated pool can stand in for the real one
(``Qwen/Qwen3-14B``) without changing the harness. ``crash`` stops a server behind the
pool manager's back, which is how tests and chaos demos exercise restart-on-crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

from backends.base import InstanceSpec, LaunchedInstance
from backends.sim.launcher import SimLauncher as _SimLauncher
from backends.sim.state import SimServerConfig


class SimLauncher(_SimLauncher):
    """Servers with the latency of (``profile``, ``gpu``, ``spec.tp``), answering to
    ``spec.model``; ``options`` are further ``SimServerConfig`` fields; ``startup_s``
    simulated seconds of start-up (divided by ``speed``; a real vLLM needs 10-60 s);
    ``max_model_len`` each server's context (None: the profile model's own)."""

    def __init__(self, *, profile: str = "qwen3-14b", gpu: str = "H100", speed: float = 1.0,
                 seed: int = 0, options: Mapping[str, Any] | None = None,
                 startup_s: float = 0.0, host: str = "127.0.0.1",
                 max_model_len: int | None = None) -> None:
        opts: dict[str, Any] = {"scheduling_policy": "priority", **(options or {})}
        if max_model_len is not None:
            opts["max_model_len"] = max_model_len
        template = SimServerConfig(model=profile, gpu=gpu, speed=speed, seed=seed, **opts)
        super().__init__(template, host=host, startup_s=startup_s)

    def config_for(self, spec: InstanceSpec) -> SimServerConfig:
        seed = self.template.seed + sum(map(ord, spec.id))
        return dataclasses.replace(self.template, tp=spec.tp, served_model_name=spec.model,
                                   seed=seed, weights_path=spec.weights_path
                                   or self.template.weights_path)

    async def crash(self, instance: LaunchedInstance) -> None:
        """End the server without telling anyone (its ``alive`` turns false)."""
        running: Any = instance.handle
        running.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.shield(running.task)
