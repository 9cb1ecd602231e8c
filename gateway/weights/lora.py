"""A LoRA adapter as a weight update: loaded beside the running ones, no engine paused.

``POST /admin/weight-update`` with ``method: "lora"`` runs, as a job:

* ``check``: the adapter directory is one vLLM can load (:func:`check_adapter`), the base
  model is served, an engine is running, the version is new. A failed check is a 400 (or
  409) before any job starts, and nothing changes.
* ``load``: every engine loads the adapter under its own name
  (:func:`gateway.adapters.adapter_name`). If one refuses, the engines that took it
  unload it again (``rollback``) and the job fails: calls go on with the adapter and
  version they had.
* ``switch``: it becomes its family's current adapter (the base model's own, or a LoRA
  family named by ``model``: :mod:`gateway.adapters`); calls for the family dispatched
  from here on run on it and are stamped with its version (the family's weight version,
  which its staleness bound counts in; the base's own family's is the gateway's). Calls
  already running finish on the adapter they started on, under its version: an engine
  serves each request on the adapter it names. Other families are not touched.
* ``unload``: adapters past the ``keep`` most recent are unloaded (default: the staleness
  bound plus one, so every call the bound still admits keeps its adapter; without a bound,
  two). A failed unload leaves an adapter loaded and is reported, not failed: the update
  itself happened.

The engines a pool starts later get every current adapter before they are admitted
(:meth:`gateway.pool.keeper.WeightKeeper.admit`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from gateway.adapters import Adapter
from gateway.dispatch.backends import Backend
from gateway.errors import BadRequest, Conflict
from gateway.pool import engines
from gateway.pool.jobs import Job, JobStatus
from gateway.runtime import Runtime
from gateway.weights.aborts import enforce_staleness
from gateway.weights.update import EngineAnswer, each_engine, update_engines, weights_held

#: files vLLM's LoRA loader takes the adapter's weights from
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
#: adapters kept loaded when no staleness bound says how many versions a call may lag
DEFAULT_KEEP = 2


def check_adapter(path: str) -> tuple[list[str], int | None]:
    """Why vLLM could not load the adapter at ``path`` (empty if it can), and its rank.
    vLLM's own checks against the engine (``--max-lora-rank``, target modules) are the
    engine's to make: a refusal there rolls the update back. Blocking (file system)."""
    p = Path(path)
    if not p.is_absolute():
        return [f"lora_path {path!r} is not absolute (engines resolve it in their own "
                "working directory)"], None
    if not p.is_dir():
        return [f"lora_path {path!r} " + ("is not a directory" if p.exists()
                                          else "does not exist")], None
    if not os.access(p, os.R_OK | os.X_OK):
        return [f"lora_path {path!r} is not readable"], None
    problems = []
    rank = None
    try:
        config = json.loads((p / "adapter_config.json").read_text())
    except FileNotFoundError:
        problems.append(f"{path}: no adapter_config.json")
    except (OSError, ValueError) as exc:
        problems.append(f"{path}: unreadable adapter_config.json ({exc})")
    else:
        if not isinstance(config, dict):
            problems.append(f"{path}: adapter_config.json is not an object")
        else:
            if str(config.get("peft_type", "LORA")).upper() != "LORA":
                problems.append(f"{path}: peft_type {config.get('peft_type')!r}; vLLM "
                                "serves LORA adapters only")
            r = config.get("r")
            if type(r) is not int or r < 1:
                problems.append(f"{path}: adapter_config.json 'r' must be a positive "
                                f"integer, not {r!r}")
            else:
                rank = r
            if config.get("bias", "none") != "none":
                problems.append(f"{path}: adapter bias {config.get('bias')!r} (vLLM "
                                "supports bias 'none' only)")
    weights = [f for f in ADAPTER_WEIGHTS if (p / f).is_file()]
    if not weights:
        problems.append(f"{path}: no adapter weights ({', '.join(ADAPTER_WEIGHTS)})")
    elif not os.access(p / weights[0], os.R_OK):
        problems.append(f"{path}: {weights[0]} is not readable")
    return problems, rank


def base_weights_locked(rt: Runtime) -> str | None:
    """Why the base weights may not change now (a 409), if they may not: calls on an
    adapter are stamped with the adapter's version, which would not say that the weights
    under it changed, so a full update, a reload or a new version label is refused while
    adapters are loaded."""
    if not rt.adapters:
        return None
    names = ", ".join(a.name for a in rt.adapters)
    return (f"LoRA adapters are loaded ({names}): calls on them are stamped with the "
            "adapter's version, which would not tell tokens from new base weights apart; "
            "push the change as an adapter (method 'lora')")


def keep_for(rt: Runtime, asked: int | None, model: str) -> int:
    """How many adapters of ``model``'s family stay loaded (the current one included)."""
    if asked is not None:
        return asked
    bound = rt.bound_for(model)
    return bound + 1 if bound is not None else DEFAULT_KEEP


def refusal(rt: Runtime, adapter: Adapter, targets: list[Backend]) -> str | None:
    """Why the update must not start (a 409), if it must not."""
    base, family = adapter.base, adapter.family
    served = rt.dispatcher.registry.known_models()
    if base not in served:
        return (f"base model {base!r} is not served (served: {sorted(served)}); "
                "name it in 'base_model'")
    if family != base and family in served:
        return f"model {family!r} is a served base model, not a LoRA family"
    if (known := rt.adapters.base_of(family)) not in (None, base):
        return f"model {family!r} is a LoRA family of {known!r}, not of {base!r}"
    if not targets:
        return "no engine to load the adapter on: start one first"
    if any(a.version == adapter.version for a in rt.adapters.loaded(family)):
        return f"adapter version {adapter.version!r} of {family!r} is loaded already"
    return None


def default_base(rt: Runtime) -> str | None:
    """The one model the engines serve, when there is one."""
    served = rt.dispatcher.registry.known_models()
    return next(iter(served)) if len(served) == 1 else None


async def checked_update(rt: Runtime, version: str, path: str | None, *,
                         base_model: str | None, keep: int | None, model: str | None = None
                         ) -> tuple[Adapter, int, list[Backend]]:
    """The ``check`` phase, before any job: the adapter (of ``model``'s family, default
    the base's own), how many of its family's adapters stay loaded and the engines to
    load it on; BadRequest (the adapter, the base) or Conflict (the pool's state) when
    it must not start."""
    if not path:
        raise BadRequest("method 'lora' needs 'lora_path'", param="lora_path")
    problems, rank = await asyncio.to_thread(check_adapter, path)
    if problems:
        raise BadRequest("; ".join(problems), param="lora_path")
    base = base_model or (rt.adapters.base_of(model) if model else None) or default_base(rt)
    if base is None:
        raise BadRequest("several models are served: name the adapter's in 'base_model'",
                         param="base_model")
    adapter = Adapter(base, version, path, rank, "" if model in (None, base) else model)
    targets = update_engines(rt)
    if (why := refusal(rt, adapter, targets)) is not None:
        raise Conflict(why)
    return adapter, keep_for(rt, keep, adapter.family), targets


def start_lora_update_job(rt: Runtime, adapter: Adapter, *, keep: int,
                          timeout_s: float) -> Job:
    """Load -> switch -> unload, in the background, as a job (module docstring). The
    caller has checked the update (:func:`checked_update`)."""
    job = rt.jobs.create("weight-update", {"version": adapter.version, "method": "lora",
                                           "lora_path": adapter.path, "base": adapter.base,
                                           "model": adapter.family, "adapter": adapter.name,
                                           "keep": keep})

    async def run() -> None:
        job.begin()
        try:
            async with weights_held(rt):  # no engine admitted while adapters change
                await _update(rt, job, adapter, keep, timeout_s)
        finally:
            job.plan["weight_version"] = rt.version_of(adapter.family)
            job.end(None if not job.errors else JobStatus.FAILED)

    rt.jobs.track(asyncio.create_task(run(), name=f"lora-update-{job.id}"))
    return job


async def _update(rt: Runtime, job: Job, adapter: Adapter, keep: int,
                  timeout_s: float) -> None:
    targets = update_engines(rt)
    with job.phase("check", adapter=adapter.to_dict(), engines=[b.id for b in targets]):
        # the files were checked before the job (checked_update); what runs may have
        # changed since: no engine left, or the same version loaded by now
        if (why := refusal(rt, adapter, targets)) is not None:
            job.errors += [why, "nothing was loaded"]
            return

    async def load(b: Backend) -> EngineAnswer:
        t0 = time.monotonic()
        error = await engines.load_adapter(rt.session, b.url, adapter.name, adapter.path,
                                           timeout_s)
        return EngineAnswer(b.id, b.url, "load", error is None, time.monotonic() - t0, error)

    with job.phase("load", adapter=adapter.name) as ph:
        answers = await each_engine(targets, load)
        ph.detail["engines"] = [a.to_dict() for a in answers]
    refused = [a for a in answers if not a.ok]
    if refused:
        job.errors += [f"{a.id}: {a.error}" for a in refused]
        took = [b for b in targets if b.id not in {a.id for a in refused}]
        with job.phase("rollback") as ph:
            ph.detail["engines"] = await _unload(rt, took, [adapter], timeout_s)
        family = adapter.family
        current = rt.adapters.current(family)
        job.errors.append(f"adapter {adapter.name!r} unloaded again; calls for {family!r} "
                          "go on with " + (f"adapter {current.name!r}" if current
                                           else "the base model")
                          + f", version {rt.version_of(family)!r}")
        return
    with job.phase("switch") as ph:
        family, previous = adapter.family, rt.version_of(adapter.family)
        if not any(a.base == adapter.base for a in rt.adapters):  # its base's weights are
            rt.adapters.base_versions[adapter.base] = rt.weight_version  # fixed from now
        dropped = rt.adapters.activate(adapter, keep)
        rt.adapters.adopted.discard(family)  # this update decides from now on
        if family == adapter.base:
            rt.weight_version = adapter.version
        ph.detail.update(model=family, previous=previous, version=adapter.version,
                         loaded=[a.version for a in rt.adapters.loaded(family)])
        rt.events.emit("weight_version", f"weight version of {family} {previous} -> "
                       f"{adapter.version} (LoRA adapter {adapter.name})", model=family,
                       previous=previous, version=adapter.version, adapter=adapter.name)
        ph.detail["aborted"] = await enforce_staleness(rt)
    if dropped:
        with job.phase("unload", adapters=[a.name for a in dropped]) as ph:
            ph.detail["engines"] = await _unload(rt, update_engines(rt), dropped, timeout_s)


async def _unload(rt: Runtime, targets: list[Backend], adapters: list[Adapter],
                  timeout_s: float) -> list[dict[str, object]]:
    """Unload ``adapters`` from ``targets``; what each engine answered (failures are
    reported: the adapter stays loaded there, which costs a slot, not a wrong token)."""
    async def one(b: Backend) -> EngineAnswer:
        t0 = time.monotonic()
        errors = [e for a in adapters
                  if (e := await engines.unload_adapter(rt.session, b.url, a.name,
                                                        timeout_s)) is not None]
        return EngineAnswer(b.id, b.url, "unload", not errors, time.monotonic() - t0,
                            "; ".join(errors) or None)

    return [a.to_dict() for a in await each_engine(targets, one)]
