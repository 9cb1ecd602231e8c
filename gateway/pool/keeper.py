"""The pool's weights: the one record of what every engine must serve, and the check an
engine passes before it joins the pool.

:class:`WeightKeeper` holds the current :class:`~gateway.pool.checkpoint.Weights` and
the lock a weight update holds from its pause to its resume. An engine the pool started
(on the current checkpoint path) is admitted only outside an update: it reloads the
current path if an update changed it meanwhile, is told the version and must say it back
(``/weight_info``), and loads every LoRA adapter the pool's engines hold. While the current
weights were pushed by the trainer, no path holds them: the engine waits, out of rotation,
for an update to bring them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

import aiohttp

from backends.base import LaunchError
from gateway.adapters import Adapters
from gateway.pool import engines
from gateway.pool.checkpoint import Weights
from gateway.pool.instance import PoolInstance

if TYPE_CHECKING:
    from gateway.metrics import EventLog

log = logging.getLogger(__name__)
#: a reload on admission can take as long as loading the model
ADMIT_TIMEOUT_S = 600.0
LABEL_TIMEOUT_S = 120.0


class _Host(Protocol):
    @property
    def session(self) -> aiohttp.ClientSession: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def adapters(self) -> Adapters: ...


class WeightKeeper:
    """What every engine of the pool must serve (module docstring)."""

    def __init__(self, host: _Host, initial: Weights) -> None:
        self.host = host
        self.current = self.initial = initial
        self.lock = asyncio.Lock()

    async def _load_adapters(self, inst: PoolInstance) -> None:
        """Every LoRA adapter loaded on the pool's engines, loaded on ``inst`` too (the
        calls it will be sent run on them; LaunchError if it cannot)."""
        assert inst.launched is not None
        for adapter in self.host.adapters:
            error = await engines.load_adapter(self.host.session, inst.launched.url,
                                               adapter.name, adapter.path, ADMIT_TIMEOUT_S)
            if error is not None:
                raise LaunchError(f"could not load LoRA adapter {adapter.name!r}: {error}")

    async def admit(self, inst: PoolInstance, *, static: bool) -> bool:
        """Bring a started engine to the current weights and check that it says so
        (LaunchError if it cannot); False if it must wait for pushed weights."""
        assert inst.launched is not None
        assert inst.backend is not None
        url, session = inst.launched.url, self.host.session
        async with self.lock:  # not while an update runs
            current = self.current
            if current.pushed:  # only the trainer has them
                inst.awaiting = current.version
                self.host.events.emit("backend", f"{inst.spec.id} waits for weights "
                                      f"{current.version!r}: the trainer pushed them and no "
                                      "path holds them; the next update brings them",
                                      backend=inst.spec.id)
                return False
            if inst.weights is not None and inst.weights.path != current.path:
                error = (await engines.reload(session, url, current.path, ADMIT_TIMEOUT_S)
                         or await engines.reset_cache(session, url, ADMIT_TIMEOUT_S))
                if error is not None:
                    raise LaunchError(f"could not load {current.describe()}: {error}")
            inst.weights = current
            reported, error = await engines.label(session, url, current.version,
                                                  LABEL_TIMEOUT_S)
        inst.backend.weight_version = reported
        if error is None:
            await self._load_adapters(inst)
            return True
        if reported is None and (static or current == self.initial):
            # no weight routes (someone else's server, or vLLM without dev mode) and the
            # weights are still the launcher's: it serves them, unchecked
            log.warning("%s: cannot check its weights: %s", inst.spec.id, error)
            return True
        raise LaunchError(f"weights check failed (expected {current.describe()}): {error}")
