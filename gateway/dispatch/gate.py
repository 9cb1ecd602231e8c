"""Admission gates in front of placement: pause for weight sync, wait for pool capacity.

Both exist so that an RL trainer can change the pool under a running rollout without
the harness seeing failures: during a weight sync new calls are held (or answered 429
with ``Retry-After``, per ``DispatchSettings.pause_mode``) while calls already running
finish; during a reconfiguration that leaves no instance routable for a while (two TP1
instances merged into one TP2 on the same GPUs), calls wait for the new instance instead
of getting 503.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal, Protocol

from gateway.config import DispatchSettings
from gateway.errors import Paused

PauseMode = Literal["wait", "reject"]
#: What the engines are told on pause (None: nothing, they keep generating).
EngineMode = Literal["wait", "keep", "abort-and-continue"]


class CapacitySource(Protocol):
    """What the dispatcher asks a managed pool (``gateway.pool.manager.PoolManager``)."""

    def expecting_capacity(self) -> bool:
        """True while instances are being started or restarted: worth waiting for."""
        ...

    def served_models(self) -> set[str]:
        """Models the pool serves even while none of its instances is registered."""
        ...


class PauseGate:
    """Open by default; ``pause`` closes it for new calls until ``resume``."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.paused_at: float | None = None
        self.mode: PauseMode | None = None
        #: The engine mode of the current (or, until the next pause, the last) pause.
        self.engine_mode: EngineMode | None = None

    async def wait_open(self, timeout_s: float) -> None:
        """Return once the gate is open; ``Paused`` (429) after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._open.wait(), timeout_s)
        except TimeoutError:
            raise Paused(f"the pool stayed paused for over {timeout_s:.0f} s",
                         retry_after_s=5.0) from None

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self, mode: PauseMode | None = None, engine_mode: EngineMode | None = None
              ) -> None:
        """Close the gate; ``mode`` overrides the settings' pause mode for this pause."""
        if not self.paused:
            self.paused_at = time.time()
        self.mode = mode
        self.engine_mode = engine_mode
        self._open.clear()

    def resume(self) -> float:
        """Open the gate; returns how long it was closed (0 if it was open)."""
        held = time.time() - self.paused_at if self.paused_at is not None else 0.0
        self.paused_at, self.mode = None, None
        self._open.set()
        return held

    async def admit(self, settings: DispatchSettings) -> None:
        """Return when a new call may be dispatched, or raise ``Paused`` (429)."""
        if not self.paused:
            return
        retry = settings.pause_retry_after_s
        if (self.mode or settings.pause_mode) == "reject":
            raise Paused("the pool is paused for a weight sync; retry later", retry_after_s=retry)
        try:
            await asyncio.wait_for(self._open.wait(), settings.pause_max_wait_s)
        except TimeoutError:
            raise Paused(
                f"the pool stayed paused for over {settings.pause_max_wait_s:.0f} s",
                retry_after_s=retry,
            ) from None
