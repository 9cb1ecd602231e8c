"""The live driver of placement: picks a backend per call and accounts in-flight load.

``acquire`` asks the active placement policy for a backend among the routable ones and
returns a :class:`Lease`; releasing the lease (exactly once, on every path) returns the
backend's in-flight count. The policies issue grows this into a queue with per-instance
concurrency caps and priorities; the proxy only ever sees ``acquire`` and ``Lease``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.dispatch.backends import Backend, BackendRegistry
from gateway.errors import ModelNotFound, NoBackendAvailable
from gateway.policies.base import BackendView, CallView, LeastLoaded, Placement


@dataclass(slots=True)
class Lease:
    backend: Backend
    priority: int | None
    queued_s: float
    released: bool = False

    def release(self, *, ok: bool = True) -> None:
        if self.released:
            return
        self.released = True
        self.backend.in_flight -= 1
        self.backend.served += 1
        if not ok:
            self.backend.failures += 1


class Dispatcher:
    def __init__(self, registry: BackendRegistry, placement: Placement | None = None) -> None:
        self.registry = registry
        self.placement: Placement = placement or LeastLoaded()

    def check_model(self, model: str) -> None:
        """404 for a model no backend serves; 503 when there is nothing to ask."""
        known = self.registry.known_models()
        if not known:
            if not any(b.routable for b in self.registry):
                raise NoBackendAvailable("no healthy backend is registered")
            return
        if model not in known:
            raise ModelNotFound(
                f"model {model!r} is not served here; available: {sorted(known)}",
                param="model",
            )

    async def acquire(self, call: CallView, model: str, exclude: Iterable[str] = ()) -> Lease:
        started = time.monotonic()
        candidates = self.registry.routable(model, exclude)
        if not candidates:
            raise NoBackendAvailable(f"no healthy backend can serve model {model!r} right now")
        views = [BackendView(b.id, b.tp or 1, b.in_flight, b.served) for b in candidates]
        chosen_id = self.placement.choose(call, views, time.monotonic())
        backend = next(b for b in candidates if b.id == chosen_id)
        backend.in_flight += 1
        return Lease(backend, None, time.monotonic() - started)
