"""The launcher protocol: how GPU servers come and go.

A *launcher* turns an :class:`InstanceSpec` (which GPUs, what TP degree, which model)
into a running OpenAI-compatible server and back. Implementations:

- ``backends.static``: externally managed URLs (no reconfiguration),
- ``backends.sim``: simulated vLLM servers in this process (demo, benchmarks, tests),
- ``backends.vllm_local``: ``python -m vllm.entrypoints.openai.api_server`` processes,
- ``backends.ray``: one Ray actor per instance, in a placement group of GPU bundles.

The pool manager (``gateway.dispatch``) only talks to this protocol, so optional heavy
parts (vLLM, Ray) never leak into the core import path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class ServerState(enum.StrEnum):
    """Where a launched server process is in its life (the pool's view); a policy sees
    only the routable state derived from it, ``gateway.policies.base.InstanceState``."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What to run: one server over ``gpus`` with tensor parallelism ``tp``.

    ``weights_path``: the checkpoint the server loads at start instead of the launcher's
    model (the pool's current weights after an update; None: the launcher's default).
    It is not part of the placement: the pool sets it when it starts the instance.
    """

    id: str
    model: str
    tp: int = 1
    gpus: tuple[int, ...] = ()
    node: str = "local"
    extra_args: tuple[str, ...] = ()
    weights_path: str | None = None


@dataclass(slots=True)
class LaunchedInstance:
    """A server a launcher started; ``url`` is its OpenAI base (no ``/v1`` suffix)."""

    spec: InstanceSpec
    url: str
    handle: object = None
    log_path: str | None = None
    meta: dict[str, str] = field(default_factory=dict)


class LaunchError(RuntimeError):
    """A server could not be started (bad spec, crashed during start, not ready in time)."""


@runtime_checkable
class Launcher(Protocol):
    """Starts and stops servers. Every method is safe to call from the event loop."""

    name: str

    async def start(self, spec: InstanceSpec) -> LaunchedInstance:
        """Start a server and return once it answers ``GET /health`` (or raise LaunchError)."""
        ...

    async def stop(self, instance: LaunchedInstance, *, grace_s: float = 10.0) -> None:
        """Stop it: graceful first, forceful after ``grace_s``. Idempotent."""
        ...

    async def alive(self, instance: LaunchedInstance) -> bool:
        """False once the server's process/actor has exited (crash detection)."""
        ...

    async def close(self) -> None:
        """Release everything this launcher still holds."""
        ...
