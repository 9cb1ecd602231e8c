"""A call's life in one place: it arrives, is dispatched (and maybe requeued), and ends once.

Each event updates together everything that follows the call: the trajectory's counters
and cached policy view (the tracker), the policy (the scheduler), the table of live calls
(aborts and weight boundaries), the backend lease and the admission slot. The relay and
the connector report events here and touch none of those directly.

A :class:`Call` owns an admitted call (its context and admission slot) and is the only way
out: :meth:`Call.end` runs once, whatever calls it later; used as a context manager it ends
the call on any exit its body did not end it on (an exception, or the client leaving),
unless the body handed the call to a streamed response, which then owns it (as an httpx
response owns its stream). A call that reached a backend is recorded
(:func:`gateway.proxy.calls.record_call`), one that did not is abandoned (it takes no
``seq``), and either way its admission slot is released; a call that failed leaves its one
line in the log (:mod:`gateway.failure_log`).
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from gateway.dispatch.dispatcher import Lease
from gateway.proxy.admission import AdmissionSlot
from gateway.proxy.calls import CallContext, record_call
from gateway.runtime import Runtime
from gateway.trajectories.state import TrajectoryState
from gateway.trajectories.tools import ToolOutcome


def arrive(rt: Runtime, state: TrajectoryState, outcomes: list[ToolOutcome],
           model: str) -> int:
    """A call of ``state`` for ``model`` arrived carrying ``outcomes`` (its new tool
    results): counted as queued, and the policy learns the outcomes before the call is
    queued. Returns the call's provisional ``seq``. The call ends through its
    :class:`Call` (or :func:`abandon` if no context was made for it)."""
    if model not in state.first_versions:  # the staleness bound counts from the start:
        state.first_versions[model] = rt.version_of(model)  # queued ones are judged too
    state.last_model = model
    seq = rt.tracker.call_arrived(state, outcomes, time.time())
    rt.dispatcher.scheduler.call_arrived(state)
    return seq


def dispatched(rt: Runtime, ctx: CallContext, lease: Lease,
               queued_s: float | None = None) -> None:
    """The scheduler gave ``ctx`` to ``lease``'s backend; a call for a model with LoRA
    adapters runs on its current one (:mod:`gateway.adapters`). ``queued_s``: how long it
    waited for this backend (default: since it arrived)."""
    ctx.bind(lease, rt.version_of(ctx.model), rt.adapters.current(ctx.model))
    rt.live_calls.add(ctx.id, lease.backend.id, ctx.body,
                       ctx.mark_version if ctx.stream else None, ctx.state.id)
    rt.tracker.call_dispatched(ctx.state, lease.backend.id,
                               time.monotonic() - ctx.arrived if queued_s is None else queued_s)


def requeue(rt: Runtime, ctx: CallContext, *, keep_out: list[str] | None) -> None:
    """Back to the queue before anything reached the client (its backend failed first);
    ``keep_out`` (if given) collects the backend so the next try goes elsewhere."""
    lease = ctx.lease
    assert lease is not None, "requeue of a call that was not dispatched"
    lease.release(ok=False)
    rt.live_calls.remove(ctx.id)
    if keep_out is not None:
        keep_out.append(lease.backend.id)
    ctx.lease = None
    rt.tracker.call_requeued(ctx.state)
    ctx.retries += 1


async def move(rt: Runtime, ctx: CallContext) -> None:
    """The engine ``ctx`` waits to go on from is being retired (a relayout at a weight
    push, :mod:`gateway.weights.job`): back to the queue with its tokens, and on to the
    backend the scheduler places it on (its continuation is token in, so any engine of
    its model can take it)."""
    old = ctx.lease
    assert old is not None, "move of a call that was not dispatched"
    old.release()  # its slot frees now (the retired engine drains), the lease stays the
    rt.live_calls.remove(ctx.id)  # call's until another one is had: if none is, the
    rt.tracker.call_requeued(ctx.state)  # call is recorded on it with what it made
    try:
        lease = await rt.dispatcher.acquire(ctx.view(), ctx.served or ctx.body["model"], (),
                                            ctx.model or None)
    except BaseException:
        rt.tracker.call_dispatched(ctx.state, old.backend.id, 0.0)
        raise
    # the call's stamp and clock stay its first dispatch's (the tokens so far were made
    # there; the continuation marks where the rest begins)
    made_by, started = ctx.weight_version, ctx.dispatched_at
    dispatched(rt, ctx, lease, lease.queued_s)
    ctx.weight_version, ctx.dispatched_at = made_by, started


def abandon(rt: Runtime, state: TrajectoryState) -> None:
    """A call that arrived but never got a context (its request failed to prepare)."""
    rt.tracker.call_abandoned(state)


#: why a call that ended with no outcome of its own ended: its client went away
CLIENT_LEFT = "client disconnected"


class Call:
    """An admitted call, from its admission slot to its record; it ends exactly once.

    ``with call:`` ends it on leaving the block unless it ended there or was handed to a
    streamed response (:meth:`hand_off`): with the exception that left the block, or as
    cancelled by the client when the block was left without an outcome (the relay returns
    a 499 when the client went away first)."""

    __slots__ = ("_ended", "_handed_off", "_slot", "ctx", "rt")

    def __init__(self, rt: Runtime, ctx: CallContext, slot: AdmissionSlot) -> None:
        self.rt, self.ctx, self._slot = rt, ctx, slot
        self._ended = self._handed_off = False

    @property
    def ended(self) -> bool:
        return self._ended

    def hand_off(self) -> Call:
        """A streamed response owns the call from here and ends it when it closes: the
        ``with`` block that admitted it returns before the stream is sent."""
        self._handed_off = True
        return self

    def __enter__(self) -> Call:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.end(error=exc)
        elif not self._handed_off:
            self.end(error=asyncio.CancelledError(CLIENT_LEFT))

    def end(self, *, error: BaseException | None = None,
            backend_ok: bool | None = None) -> None:
        """The call is over, however it ended. Once: later calls do nothing.

        ``backend_ok``: whether the outcome says the backend works (default: unless the
        call failed); an engine refusing the client's request is a failed call, not a
        failed backend."""
        if self._ended:
            return
        self._ended = True
        rt, ctx = self.rt, self.ctx
        if error is not None:
            rt.failure_log.failed(ctx.state.id, ctx.endpoint, error)
        try:
            if ctx.lease is None:  # never reached a backend: refused, or the client left
                rt.tracker.call_abandoned(ctx.state)
            else:
                record_call(rt, ctx, error=error, backend_ok=backend_ok)
        finally:
            self._slot.release()
