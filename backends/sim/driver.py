"""The async driver: runs an :class:`EngineCore` in (compressed) real time for a server.

One background task loops: take a batch of engine steps worth about ``tick_s`` of
simulated time, sleep until their simulated end, then deliver the tokens they emitted to
per-request queues (one queue item per request per tick, however many steps it spans).
Batching ticks instead of sleeping every ~10 ms step is what lets eight servers at 20-50x
speed share one Python process: the cost is that a request arriving mid-tick joins the
batch at the tick's end (at most ``tick_s`` of simulated time late; a real engine makes
it wait for the current step, so the error is ``tick_s`` minus one step).

If the process cannot keep up, simulated time slips rather than the engine running
ahead of the clock: the next batch starts at "now", and ``lag_s`` records the loss.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from backends.sim.clock import Clock, WallClock
from backends.sim.engine import EngineCore
from backends.sim.request import FinishReason, SimRequest, StepOutput


@dataclass(slots=True)
class Delta:
    """Tokens a request gained since its previous delta, and its end if it ended."""

    num_new: int
    finish: FinishReason | None = None


@dataclass(slots=True, eq=False)
class RequestHandle:
    """The live side of one submitted request (simulated timestamps in seconds)."""

    request: SimRequest
    arrival: float
    first_token_at: float | None = None
    finished_at: float | None = None
    num_generated: int = 0
    finish: FinishReason | None = None
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    #: ``[start, end, weight version]`` over the delivered output tokens, as vLLM's
    #: output processor tracks them (``weight_version_starts``)
    spans: list[list[Any]] = field(default_factory=list)

    def delivered(self, n: int, version: str) -> None:
        """``n`` more tokens reached the client, made by the weights labelled ``version``."""
        start = self.num_generated
        self.num_generated += n
        if self.spans and self.spans[-1][2] == version:
            self.spans[-1][1] = self.num_generated
        else:
            self.spans.append([start, self.num_generated, version])

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas until (and including) the one that finishes the request."""
        while True:
            delta = await self.queue.get()
            yield delta
            if delta.finish is not None:
                return


FinishedHook = Callable[[RequestHandle], None]


class SimEngine:
    """Owns the engine loop; ``submit``/``abort`` are called from request handlers."""

    def __init__(self, core: EngineCore, clock: Clock, *, tick_s: float = 0.2,
                 on_finished: FinishedHook | None = None) -> None:
        self.core = core
        self.clock = clock
        self.tick_s = tick_s  # simulated seconds per delivery batch
        self.on_finished = on_finished
        self.lag_s = 0.0
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        #: Set while generation is paused (``/pause``): no step runs until ``resume``.
        self.paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        #: the label of the weights the steps run with (vLLM ``/weight_info``)
        self.weight_version = "default"
        #: clear while a batch of steps has run and its tokens are not delivered yet
        self._delivered = asyncio.Event()
        self._delivered.set()
        #: held by each batch of steps and by each utility call between batches (an
        #: adapter load), which vLLM's engine core runs between two steps
        self._core = asyncio.Lock()
        self._held = False  # a utility call ran since the last batch: start anew
        self.held_s = 0.0  # simulated seconds the loop spent in utility calls
        #: every delivered token's time since the one before it, summed, and how many:
        #: ``vllm:inter_token_latency_seconds`` (a request's first token has none)
        self.itl_sum = 0.0
        self.itl_count = 0

    async def submit(self, req: SimRequest) -> RequestHandle:
        """Queue a request after the per-request API overhead; ValueError if it can't fit."""
        handle = RequestHandle(req, arrival=self.clock.now())
        await self.clock.sleep(self.core.profile.request_overhead_ms / 1000.0)
        req.arrival = handle.arrival
        self.core.add_request(req)
        self._handles[req.id] = handle
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> bool:
        """Drop a request (client went away); True if it was still in the engine."""
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle.finish = FinishReason.ABORT
        return self.core.abort(request_id)

    def pause(self) -> None:
        """Stop stepping after the current batch; requests stay queued (vLLM ``keep``)."""
        self.paused = True
        self._resumed.clear()

    async def settled(self) -> None:
        """Return once the tokens of the steps already run are delivered (vLLM answers a
        pause once its output queue is empty)."""
        await self._delivered.wait()

    def abort_ids(self, request_ids: set[str]) -> int:
        """Finish the requests whose id (or id before ``-<choice>``) is in
        ``request_ids`` with ``abort`` and the tokens delivered so far."""
        found = [h for rid, h in self._handles.items()
                 if rid in request_ids or rid.rsplit("-", 1)[0] in request_ids]
        for handle in found:
            del self._handles[handle.request.id]
            self.core.abort(handle.request.id)
            handle.finish = FinishReason.ABORT
            handle.queue.put_nowait(Delta(0, FinishReason.ABORT))
        return len(found)

    def abort_in_flight(self) -> int:
        """Finish every request with ``abort`` and the tokens it has so far delivered;
        returns how many there were. Their readers get a final abort delta."""
        handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            self.core.abort(handle.request.id)
            handle.finish = FinishReason.ABORT
            handle.queue.put_nowait(Delta(0, FinishReason.ABORT))
        return len(handles)

    async def drained(self, poll_s: float = 0.005) -> None:
        """Return once no request is left in the engine (vLLM ``wait``)."""
        while self.core.has_work or self._handles:  # noqa: ASYNC110 - polled, like vLLM
            await asyncio.sleep(poll_s)

    async def hold(self, seconds: float) -> None:
        """Run a utility call that takes ``seconds`` of simulated time on the engine loop
        (an adapter load): it waits for the batch running now, and no step runs until it
        ends; requests stay queued."""
        async with self._core:
            await self.clock.sleep(seconds)
            self.held_s += seconds
            self._held = True

    def resume(self) -> None:
        self.paused = False
        self._resumed.set()
        self._wake.set()

    async def run(self) -> None:
        """The engine loop; runs until cancelled."""
        t_free = self.clock.now()
        while True:
            if self.paused:
                await self._resumed.wait()
                t_free = self.clock.now()
            if not self.core.has_work:
                self._wake.clear()
                await self._wake.wait()
                t_free = self.clock.now()  # an idle engine starts when work arrives
            async with self._core:
                if self.paused or not self.core.has_work:  # changed while a utility
                    continue                               # call held the loop
                t_free = await self._batch(t_free)

    async def _batch(self, t_free: float) -> float:
        """Run, sleep out and deliver one batch of steps; returns when the engine is free."""
        now = self.clock.now()
        if self._held:  # a utility call held the loop: that time is not lag
            self._held = False
            t_free = max(t_free, now)
        if now > t_free + self.tick_s:  # fell behind: let simulated time slip
            self.lag_s += now - t_free - self.tick_s
            if isinstance(self.clock, WallClock):
                self.clock.fell_behind(self, now - t_free - self.tick_s)
            t_free = now - self.tick_s
        start = t_free
        version = self.weight_version  # it only changes while paused, between batches
        batch = self._run_batch()
        t_free = start + sum(o.duration_s for o in batch)
        self._delivered.clear()
        try:
            await self.clock.sleep(t_free - self.clock.now())
            self._deliver(batch, start, version)
        finally:
            self._delivered.set()
        return t_free

    def _run_batch(self) -> list[StepOutput]:
        batch: list[StepOutput] = []
        elapsed = 0.0
        while self.core.has_work and elapsed < self.tick_s:
            out = self.core.step(horizon_s=self.tick_s - elapsed)
            batch.append(out)
            elapsed += out.duration_s
        return batch

    def _deliver(self, batch: list[StepOutput], start: float, version: str) -> None:
        pending: dict[str, tuple[RequestHandle, Delta]] = {}
        t = start
        for out in batch:
            t += out.duration_s
            per_step = out.duration_s / max(1, out.num_steps)
            for rid, n in out.emitted.items():
                handle = self._handles.get(rid)
                if handle is None:  # aborted meanwhile
                    continue
                later = n if handle.first_token_at is not None else n - 1
                self.itl_sum += per_step * later
                self.itl_count += later
                if handle.first_token_at is None:
                    handle.first_token_at = t
                handle.delivered(n, version)
                pending.setdefault(rid, (handle, Delta(0)))[1].num_new += n
            for rid, reason in out.finished:
                handle = self._handles.pop(rid, None)
                if handle is None:
                    continue
                handle.finished_at, handle.finish = t, reason
                pending.setdefault(rid, (handle, Delta(0)))[1].finish = reason
                if self.on_finished is not None:
                    self.on_finished(handle)
        for handle, delta in pending.values():
            handle.queue.put_nowait(delta)
