"""Admission and placement of calls: the proxy's single entry point, ``acquire``.

``acquire`` passes the admission gates (pause for weight sync, wait for pool capacity),
then queues the call in the :class:`~gateway.dispatch.scheduler.Scheduler`, where the
active trajectory-aware policy decides when it runs, where, and with which vLLM
priority. It returns a :class:`Lease`; releasing the lease (exactly once, on every path)
returns the backend's in-flight slot and lets the scheduler dispatch the next call.

Pool reconfiguration contract (``gateway.pool.manager``), which any placement code here
must keep:

- only ``Backend.routable`` backends (healthy and ``state == READY``) get NEW calls. A
  ``DRAINING`` backend gets none, not even the next call of a trajectory that ran there:
  every new call of a trajectory starts after a tool gap, and that is where it moves.
  Calls already holding a lease on it finish; the pool stops it once its ``in_flight``
  reaches 0 (or after the drain timeout), so ``in_flight`` must be incremented in the
  same synchronous step that picks the backend (no ``await`` in between);
- while the pool is paused for a weight sync, new calls are held or refused (``gate``);
- while the pool is starting instances and none is routable, calls wait for one
  (bounded by ``DispatchSettings.backend_wait_s``) rather than failing with 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.config import DispatchSettings
from gateway.dispatch.backends import Backend, BackendRegistry
from gateway.dispatch.gate import CapacitySource, PauseGate
from gateway.dispatch.scheduler import Scheduler
from gateway.errors import ModelNotFound, NoBackendAvailable
from gateway.policies.base import CallView


@dataclass(slots=True)
class Lease:
    backend: Backend
    priority: int | None
    queued_s: float
    on_release: Callable[[], None] | None = None
    released: bool = False

    def release(self, *, ok: bool = True) -> None:
        if self.released:
            return
        self.released = True
        self.backend.in_flight -= 1
        self.backend.served += 1
        if not ok:
            self.backend.failures += 1
        if self.on_release is not None:
            self.on_release()


class Dispatcher:
    def __init__(
        self,
        registry: BackendRegistry,
        scheduler: Scheduler,
        settings: DispatchSettings | None = None,
    ) -> None:
        self.registry = registry
        self.scheduler = scheduler
        self.settings = settings or DispatchSettings()
        self.gate = PauseGate()
        #: Set by a managed pool so calls wait for instances it is starting.
        self.capacity: CapacitySource | None = None
        scheduler.expecting_capacity = self._expecting

    def check_model(self, model: str) -> None:
        """404 for a model no backend serves; 503 when there is nothing to ask."""
        known = self.registry.known_models()
        if self.capacity is not None:
            known |= self.capacity.served_models()
        if not known:
            if not any(b.routable for b in self.registry) and not self._expecting():
                raise NoBackendAvailable("no healthy backend is registered")
            return
        if model not in known:
            raise ModelNotFound(
                f"model {model!r} is not served here; available: {sorted(known)}",
                param="model",
            )

    async def acquire(self, call: CallView, model: str, exclude: Iterable[str] = (),
                      family: str | None = None) -> Lease:
        """A slot on a backend of ``model`` for ``call``; ``family`` is the model the call
        is for when it is a LoRA family of ``model`` (its share of the slots)."""
        started = time.monotonic()
        if not exclude:  # a retry of a call already admitted is not held again
            await self.gate.admit(self.settings)
        await self._candidates(model, exclude)
        family = family or model
        backend, priority = await self.scheduler.place(
            call.trajectory_id, call.seq, call.context_tokens, model, exclude, family)
        return Lease(backend, priority if self.settings.send_priority else None,
                     time.monotonic() - started,
                     on_release=lambda: self.scheduler.released(family))

    @property
    def policy_name(self) -> str:
        return self.scheduler.policy.name

    def _expecting(self) -> bool:
        return self.capacity is not None and self.capacity.expecting_capacity()

    async def _candidates(self, model: str, exclude: Iterable[str]) -> list[Backend]:
        """Routable backends for ``model``; while the pool is bringing instances up and
        none is routable, poll for one until ``backend_wait_s`` runs out."""
        exclude = tuple(exclude)
        deadline = time.monotonic() + self.settings.backend_wait_s
        while not (candidates := self.registry.routable(model, exclude)):
            if not self._expecting() or time.monotonic() >= deadline:
                raise NoBackendAvailable(
                    f"no healthy backend can serve model {model!r} right now")
            await asyncio.sleep(0.1)
        return candidates
