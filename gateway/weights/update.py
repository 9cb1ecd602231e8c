"""Weight updates that reach the engines: pause, hand over new weights, resume.

``pause_engines`` closes the gateway's gate and pauses every engine through vLLM's own
routes (``gateway.pool.engines``), deciding per engine from the calls it runs
(``gateway.live_calls``):

* ``wait``: each engine finishes what it runs, then stops; the pause answers when idle.
* ``abort-and-continue``: each engine aborts what it runs (vLLM ``abort``); the relay
  holds the clients and continues their calls token-in after resume
  (``gateway.proxy.continuation``). An engine running a *stream* that cannot be
  continued (tool parsing, structured output, ``n > 1``) is paused with ``keep``
  instead, and its other calls are aborted one by one (``/abort_requests``).
* ``keep``: each engine freezes its streams in place; they go on after resume. Calls
  that are not streamed are aborted one by one and finished after resume (their clients
  have seen nothing, and an abort's answer carries the engine's exact token count).

``resume_engines`` then, engine by engine: aborts the calls that reached it just after
the pause (they wait in its queue), lets frozen streams deliver what the engine made
before the pause, drops every KV block of the old weights, sets the new version and
reads back the engine's own label (``/weight_info``), records it as the boundary of
each frozen stream and as the engine's label for new calls, resumes it; then opens the
gate. An engine whose label is not the new version is taken out of rotation.

``gateway.weights.job`` runs the whole cycle as an admin job, after checking the
update first (the checkpoint, the engines) so that a bad update pauses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from backends.base import ServerState
from gateway.dispatch.backends import Backend
from gateway.dispatch.gate import EngineMode, PauseMode
from gateway.live_calls import LiveCall, LiveCalls, engine_ids
from gateway.pool import engines
from gateway.pool.checkpoint import Weights
from gateway.pool.spec import stream_interval
from gateway.runtime import Runtime
from gateway.weights.aborts import enforce_staleness

ENGINE_CALL = {"wait": "wait", "keep": "keep", "abort-and-continue": "abort"}
#: a frozen stream has delivered what its paused engine made once it was quiet this long
SETTLE_QUIET_S = 0.2
SETTLE_MAX_S = 2.0


@dataclass(slots=True)
class EngineAnswer:
    id: str
    url: str
    mode: str
    ok: bool
    seconds: float
    error: str | None = None
    detail: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "mode": self.mode, "ok": self.ok,
                "seconds": round(self.seconds, 4), "error": self.error,
                **(self.detail or {})}


def update_engines(rt: Runtime) -> list[Backend]:
    """The engines an update covers: every registered engine in service (routable or
    not; a draining one finishes its calls under its own label and goes away) and the
    engines the pool holds back until they get pushed weights."""
    found = [b for b in rt.registry if b.state is ServerState.READY]
    return found + (rt.pool.held() if rt.pool is not None else [])


def current_weights(rt: Runtime) -> Weights:
    return rt.pool.weights if rt.pool is not None else Weights(rt.weight_version)


async def each_engine(targets: list[Backend], work: Callable[[Backend], Awaitable[EngineAnswer]]
                ) -> list[EngineAnswer]:
    return list(await asyncio.gather(*(work(b) for b in targets)))


def _plan(calls: dict[str, LiveCall], engine_mode: EngineMode,
          grouped: bool = False) -> tuple[str, list[str]]:
    """The pause an engine gets and the calls it aborts (see the module docstring).
    ``grouped``: the engine sends several tokens an event (vLLM ``--stream-interval``)
    and holds up to that many it made unsent across a pause, so a stream frozen by
    ``keep`` could not be told which weights made them: the engine finishes such streams
    instead (``wait``, after the others are aborted)."""
    if engine_mode == "wait":
        return "wait", []
    frozen = {cid for cid, c in calls.items()
              if c.stream and (engine_mode == "keep" or not c.continuable)}
    rest = [cid for cid in calls if cid not in frozen]
    if grouped and (frozen or engine_mode == "keep"):  # keep: even a stream placed late
        return "wait", rest
    return ("abort" if engine_mode == "abort-and-continue" and not frozen else "keep"), rest


def _ids(call_ids: list[str]) -> list[str]:
    return [name for cid in call_ids for name in engine_ids(cid)]


async def pause_engines(rt: Runtime, engine_mode: EngineMode, timeout_s: float,
                        admission: PauseMode | None = None,
                        targets: list[Backend] | None = None) -> dict[str, Any]:
    """Close the gate and pause every engine; answers once all are idle (or failed)."""
    gate = rt.dispatcher.gate
    gate.pause(admission, engine_mode)
    started = time.monotonic()
    live = rt.live_calls
    grouped = rt.pool is not None and stream_interval(rt.pool.spec) > 1

    async def one(b: Backend) -> EngineAnswer:
        mode, abort = _plan(live.on(b.id), engine_mode, grouped)
        live.mark_aborted(abort)  # before the call: the aborts can arrive before its answer
        live.paused[b.id] = mode
        t0 = time.monotonic()
        error = None
        if mode == "wait" and abort:  # a grouping engine: abort these, finish the rest
            error = await engines.abort_requests(rt.session, b.url, _ids(abort), timeout_s)
        error = error or await engines.call(rt.session, b.url, "POST", f"/pause?mode={mode}",
                                            timeout_s)
        if mode == "wait":  # its streams that had begun ran to their end on the old
            # weights (one with no token yet may be held back by the pause: it is marked
            # at resume as before)
            live.finished[b.id] = {cid for cid, c in live.on(b.id).items()
                                   if c.stream and c.last_token}
        if error is None and mode == "keep":
            error = await engines.abort_requests(rt.session, b.url, _ids(abort), timeout_s)
        return EngineAnswer(b.id, b.url, mode, error is None, time.monotonic() - t0, error,
                            {"aborted": len(abort)})

    answers = await each_engine(update_engines(rt) if targets is None else targets, one)
    idle_s = time.monotonic() - started
    rt.events.emit("pause", f"engines paused ({engine_mode}) in {idle_s:.3f} s",
                   mode=engine_mode, idle_s=round(idle_s, 4))
    return {"engine_mode": engine_mode, "idle_s": round(idle_s, 4),
            "engines": [a.to_dict() for a in answers],
            "ok": all(a.ok for a in answers)}


async def _settle(calls: list[LiveCall]) -> None:
    """Wait until none of ``calls`` got a token for ``SETTLE_QUIET_S`` (bounded)."""
    deadline = time.monotonic() + SETTLE_MAX_S
    while calls:
        now = time.monotonic()
        wait = min(max(c.last_token for c in calls) + SETTLE_QUIET_S, deadline) - now
        if wait <= 0:
            return
        await asyncio.sleep(wait)


async def _resume_one(rt: Runtime, live: LiveCalls, b: Backend, version: str | None,
                      timeout_s: float) -> EngineAnswer:
    """One engine, paused or not: late calls aborted, streams settled, caches dropped,
    version set and read back, frozen streams marked, resumed."""
    t0 = time.monotonic()
    errors: list[str] = []
    detail: dict[str, Any] = {}
    calls = live.on(b.id)
    if live.paused.pop(b.id, None) is not None:
        # what has no abort's end yet: it reached the engine after the pause and waits in
        # its queue (abort it too: it then starts again on the new weights), or it ended
        # before the pause and its answer is on its way (nothing to abort)
        late = [cid for cid, c in calls.items() if (c.aborted or not c.stream)
                and not c.answered]
        live.mark_aborted(late)
        errors.append(await engines.abort_requests(rt.session, b.url, _ids(late), timeout_s)
                      or "")
        done = live.finished.pop(b.id, set())  # a wait: these ended on the old weights
        calls = {cid: c for cid, c in calls.items() if cid not in done}
        await _settle([c for c in calls.values() if c.frozen])
    if version is not None:
        errors.append(await engines.reset_cache(rt.session, b.url, timeout_s) or "")
        reported, error = await engines.label(rt.session, b.url, version, timeout_s)
        errors.append(error or "")
        label = reported or version  # an engine that reports nothing: as told
        if label != b.weight_version:
            for c in calls.values():
                if c.frozen and c.on_version is not None:
                    c.on_version(label)
        b.weight_version = reported
        detail["weight_version"] = reported
        if reported is not None and reported != version:
            take_out(rt, b, f"its /weight_info says {reported!r}, not {version!r}")
    resumed = await engines.call(rt.session, b.url, "POST", "/resume", timeout_s)
    failed = [e for e in errors if e]
    return EngineAnswer(b.id, b.url, "resume", resumed is None, time.monotonic() - t0,
                        resumed or ("; ".join(failed) if failed else None), detail)


def take_out(rt: Runtime, b: Backend, reason: str) -> None:
    """``b`` does not serve what its label says: out of rotation (a pool instance is
    restarted on the pool's weights; another engine stays out until an update)."""
    if rt.pool is not None and rt.pool.fail(b.id, reason):
        return
    b.state, b.last_error = ServerState.FAILED, reason[:300]
    rt.events.emit("backend", f"{b.id}: {reason}", backend=b.id, state="failed")


async def resume_all(rt: Runtime, version: str | None, timeout_s: float,
                  targets: list[Backend], weights: Weights | None) -> dict[str, Any]:
    live = rt.live_calls
    answers = await each_engine(targets, lambda b: _resume_one(rt, live, b, version, timeout_s))
    if version is not None and version != rt.weight_version:
        previous, rt.weight_version = rt.weight_version, version
        rt.events.emit("weight_version", f"weight version {previous} -> {version}",
                       previous=previous, version=version)
    if weights is not None and rt.pool is not None:
        await rt.pool.commit(weights, {b.id: b.weight_version for b in targets})
    await enforce_staleness(rt)  # before the gate opens: no stale call starts again
    gate = rt.dispatcher.gate
    was_paused = gate.paused
    held = gate.resume()
    if was_paused:
        rt.events.emit("resume", f"resumed after {held:.1f} s", paused_s=round(held, 3))
    return {"paused_s": round(held, 3), "weight_version": rt.weight_version,
            "engines": [a.to_dict() for a in answers], "ok": all(a.ok for a in answers)}


@contextlib.asynccontextmanager
async def weights_held(rt: Runtime) -> AsyncIterator[None]:
    """No engine is admitted to the pool while its weights change."""
    if rt.pool is None:
        yield
        return
    async with rt.pool.weights_lock:
        yield


async def resume_engines(rt: Runtime, version: str | None, timeout_s: float
                         ) -> dict[str, Any]:
    """Set ``version`` (if given) on the engines, resume them, open the gate
    (``POST /admin/resume``). The gateway cannot know what the trainer loaded: a new
    version becomes the pool's as weights that only the trainer holds."""
    async with weights_held(rt):
        old = current_weights(rt)
        new = (Weights(version, old.path, pushed=True)
               if version is not None and version != old.version else None)
        return await resume_all(rt, version, timeout_s, update_engines(rt), new)


async def relabel(rt: Runtime, version: str, timeout_s: float = 30.0) -> dict[str, str]:
    """``PUT /admin/weight-version``: the operator says the engines now serve ``version``
    (the trainer loaded it itself). Every engine drops its cached KV and is told, so that
    its own label, which its calls are stamped with, says so; the pool keeps the version
    as weights only the trainer holds (an engine started later waits for an update to
    bring them)."""
    async def one(b: Backend) -> tuple[str | None, str | None]:
        if version != b.weight_version:  # KV computed with other weights is not valid
            await engines.reset_cache(rt.session, b.url, timeout_s)
        return await engines.label(rt.session, b.url, version, timeout_s)

    async with weights_held(rt):
        targets = update_engines(rt)
        labels = await asyncio.gather(*(one(b) for b in targets))
        for b, (reported, _) in zip(targets, labels, strict=True):
            b.weight_version = reported
        old = current_weights(rt)
        previous, rt.weight_version = rt.weight_version, version
        if rt.pool is not None and version != old.version:
            await rt.pool.commit(Weights(version, old.path, pushed=True),
                                 {b.id: b.weight_version for b in targets})
    if previous != version:
        rt.events.emit("weight_version", f"weight version {previous} -> {version} (set)",
                       previous=previous, version=version)
        await enforce_staleness(rt)
    return {"previous": previous, "version": version}
