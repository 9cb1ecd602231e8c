"""Weight updates that reach the engines: pause, hand over new weights, resume.

``pause_engines`` closes the gateway's gate and tells every engine of the pool to pause
through vLLM's own routes (``POST /pause?mode=...``, vLLM started with
``VLLM_SERVER_DEV_MODE=1``; the simulated server has the same routes):

* ``wait``: each engine finishes what it runs, then stops; the pause answers when idle.
* ``keep``: each engine freezes its requests in place; they go on after resume (the
  gateway's idle timeout must outlast the pause for streams).
* ``abort-and-continue``: each engine aborts what it runs (vLLM ``abort``); the relay
  holds the clients and continues their calls token-in after resume
  (``gateway.proxy.continuation``). An engine running a call that cannot be continued
  (tool parsing, structured output, ``n > 1``) is paused with ``keep`` instead.

The time from the pause to the last engine answering (all idle) is measured and returned.
``resume_engines`` sets the new weight version (stamped on later calls and on
continuations), tells the engines (``/update_weight_version``, ``/resume``) and opens
the gate. ``start_weight_update_job`` runs the whole cycle as an admin job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from gateway.dispatch.backends import Backend
from gateway.dispatch.gate import EngineMode, PauseMode
from gateway.dispatch.jobs import Job, JobStatus
from gateway.proxy.live import live_calls
from gateway.runtime import Runtime

ENGINE_CALL = {"wait": "wait", "keep": "keep", "abort-and-continue": "abort"}
UpdateMethod = Literal["reload", "external"]


@dataclass(slots=True)
class EngineAnswer:
    id: str
    url: str
    mode: str
    ok: bool
    seconds: float
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "mode": self.mode, "ok": self.ok,
                "seconds": round(self.seconds, 4), "error": self.error}


async def _call(rt: Runtime, backend: Backend, method: str, path: str, timeout_s: float,
                body: dict[str, Any] | None = None) -> str | None:
    """One control call; None on a 2xx, else why it failed."""
    try:
        async with rt.session.request(method, backend.url + path, json=body,
                                      timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status < 300:
                await r.read()
                return None
            text = (await r.text())[:300]
            hint = (" (start vLLM with VLLM_SERVER_DEV_MODE=1 for its RL routes)"
                    if r.status == 404 else "")
            return f"{path} answered {r.status}{hint}: {text}"
    except TimeoutError:
        return f"{path} did not answer within {timeout_s:.0f} s"
    except aiohttp.ClientError as exc:
        return f"{path} failed: {exc}"


async def _each(rt: Runtime, work: Callable[[Backend], Awaitable[EngineAnswer]]
                ) -> list[EngineAnswer]:
    return list(await asyncio.gather(*(work(b) for b in list(rt.registry))))


async def pause_engines(rt: Runtime, engine_mode: EngineMode, timeout_s: float,
                        admission: PauseMode | None = None) -> dict[str, Any]:
    """Close the gate and pause every engine; answers once all are idle (or failed)."""
    gate = rt.dispatcher.gate
    gate.pause(admission, engine_mode)
    started = time.monotonic()
    live = live_calls(rt)

    async def one(b: Backend) -> EngineAnswer:
        mode = ENGINE_CALL[engine_mode]
        if mode == "abort" and live.blocking(b.id):
            mode = "keep"  # a call here cannot be continued token-in: freeze it instead
        if mode == "abort":  # before the call: the aborts can arrive before its answer
            live.mark_aborted(b.id)
        t0 = time.monotonic()
        error = await _call(rt, b, "POST", f"/pause?mode={mode}", timeout_s)
        return EngineAnswer(b.id, b.url, mode, error is None, time.monotonic() - t0, error)

    answers = await _each(rt, one)
    idle_s = time.monotonic() - started
    rt.events.emit("pause", f"engines paused ({engine_mode}) in {idle_s:.3f} s",
                   mode=engine_mode, idle_s=round(idle_s, 4))
    return {"engine_mode": engine_mode, "idle_s": round(idle_s, 4),
            "engines": [a.to_dict() for a in answers],
            "ok": all(a.ok for a in answers)}


async def resume_engines(rt: Runtime, version: str | None, timeout_s: float
                         ) -> dict[str, Any]:
    """Set ``version`` (if given) here and on the engines, resume them, open the gate."""
    if version is not None and version != rt.weight_version:
        if rt.dispatcher.gate.engine_mode == "keep":
            live_calls(rt).new_version(version)
        previous, rt.weight_version = rt.weight_version, version
        rt.events.emit("weight_version", f"weight version {previous} -> {version}",
                       previous=previous, version=version)

    async def one(b: Backend) -> EngineAnswer:
        t0 = time.monotonic()
        error = None
        if version is not None:
            error = await _call(rt, b, "POST", "/update_weight_version", timeout_s,
                                {"new_version": version})
        resumed = await _call(rt, b, "POST", "/resume", timeout_s)
        error = resumed or error  # failing to resume matters more than the label
        return EngineAnswer(b.id, b.url, "resume", resumed is None, time.monotonic() - t0,
                            error)

    answers = await _each(rt, one)
    gate = rt.dispatcher.gate
    was_paused = gate.paused
    held = gate.resume()
    if was_paused:
        rt.events.emit("resume", f"resumed after {held:.1f} s", paused_s=round(held, 3))
    return {"paused_s": round(held, 3), "weight_version": rt.weight_version,
            "engines": [a.to_dict() for a in answers], "ok": all(a.ok for a in answers)}


def start_weight_update_job(rt: Runtime, *, version: str, engine_mode: EngineMode,
                            method: UpdateMethod, weights_path: str | None,
                            timeout_s: float) -> tuple[Job, asyncio.Event]:
    """Pause -> update -> set version -> resume, in the background, as a job.

    ``method="reload"``: each engine reloads its weights from ``weights_path`` (vLLM
    ``/collective_rpc reload_weights``, then ``/reset_prefix_cache``). ``"external"``: the
    trainer pushes the weights itself (NCCL, vLLM's weight-transfer routes) and says so
    by setting the returned event (``POST /admin/weight-update/{job}/done``). If a step
    fails, the engines are resumed with the old version and the job fails.
    """
    job = rt.jobs.create("weight-update", {"version": version, "mode": engine_mode,
                                           "method": method, "weights_path": weights_path})
    trainer_done = asyncio.Event()
    old = rt.weight_version

    async def reload(b: Backend) -> EngineAnswer:
        t0 = time.monotonic()
        body = {"method": "reload_weights",
                "kwargs": {"weights_path": weights_path} if weights_path else {}}
        error = await _call(rt, b, "POST", "/collective_rpc", timeout_s, body)
        if error is None:  # cached prefixes were computed with the old weights
            error = await _call(rt, b, "POST", "/reset_prefix_cache", timeout_s)
        return EngineAnswer(b.id, b.url, "reload", error is None, time.monotonic() - t0, error)

    async def run() -> None:
        job.begin()
        ok = False
        try:
            with job.phase("pause", mode=engine_mode) as ph:
                paused = await pause_engines(rt, engine_mode, timeout_s)
                ph.detail.update(idle_s=paused["idle_s"], engines=paused["engines"])
            if not paused["ok"]:
                job.errors += [f"{e['id']}: {e['error']}" for e in paused["engines"]
                               if not e["ok"]]
            else:
                with job.phase("update", method=method) as ph:
                    if method == "reload":
                        answers = await _each(rt, reload)
                        ph.detail["engines"] = [a.to_dict() for a in answers]
                        job.errors += [f"{a.id}: {a.error}" for a in answers if not a.ok]
                    else:
                        try:
                            await asyncio.wait_for(trainer_done.wait(), timeout_s)
                        except TimeoutError:
                            job.errors.append(f"the trainer did not report the update "
                                              f"done within {timeout_s:.0f} s")
                ok = not job.errors
        finally:
            with job.phase("resume") as ph:
                resumed = await resume_engines(rt, version if ok else old, timeout_s)
                ph.detail.update(weight_version=resumed["weight_version"],
                                 engines=resumed["engines"])
                job.errors += [f"{e['id']}: {e['error']}" for e in resumed["engines"]
                               if not e["ok"]]
            if not ok:
                job.errors.append(f"weight update abandoned; resumed with version {old!r}")
            job.plan["weight_version"] = rt.weight_version
            job.end(None if not job.errors else JobStatus.FAILED)

    rt.jobs.track(asyncio.create_task(run(), name=f"weight-update-{job.id}"))
    return job, trainer_done
