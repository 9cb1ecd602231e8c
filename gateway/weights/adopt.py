"""What a gateway takes over from engines that outlived it.

Static backends (``ROLLOUT_GATEWAY_BACKENDS``) are vLLM servers the gateway did not start:
they keep running when the gateway restarts, holding the weights and the LoRA adapters
the last gateway's updates gave them. The gateway's own memory of those (its weight
version, its adapter table) starts empty, so without this a restarted gateway stamped
every call with its configured version while the engines served another, and sent calls
for a LoRA family to the base weights (or answered 404): tokens recorded under a version
that did not make them.

When a static backend is first seen healthy (and again after it was down), before any
call reaches it, the health checker hands its ``/v1/models`` reply here (:func:`adopt`):

* **Weight label.** The engine's ``/weight_info`` label (unless it was never set:
  vLLM's ``"default"``) becomes the backend's, which its calls are stamped with (as after
  an update). The first label read while the gateway
  still holds its configured version and has adopted none becomes the gateway's version
  (an event says so); an engine whose label differs from the gateway's is logged, its
  calls stamped with its own label.
* **Adapters.** vLLM lists each loaded adapter as a card with its base model
  (``parent``) and path (``root``). Cards named as the gateway names adapters
  (``<family>@lora-<version>``, :func:`gateway.adapters.adapter_name`) of a family the
  gateway holds no adapter of are taken into its table: the family declared on its base,
  every version found kept (numeric versions in order, else the engine's order), the
  newest current. A base's own adapters make the gateway's version the current one's.
* **Missing adapters.** A backend that lacks an adapter the table holds (a static engine
  restarted while the gateway ran, or one that missed a load) is given it before it is
  admitted; if it cannot load it, it stays out of rotation (its calls would run on
  weights they are not stamped with) and the next check tries again.

Pool engines are the pool's: the keeper brings each to the pool's weights and adapters
before admitting it (``gateway.pool.keeper``), so they are left alone here.
"""

from __future__ import annotations

import logging

import aiohttp

from gateway.adapters import Adapter, parse_adapter_name
from gateway.dispatch.backends import Backend
from gateway.pool import engines
from gateway.runtime import Runtime

log = logging.getLogger(__name__)
#: reading a label or loading an adapter while a backend is being admitted
TIMEOUT_S = 60.0


def adapter_cards(reply: object, bases: set[str]) -> list[Adapter]:
    """The adapters a ``/v1/models`` reply lists on one of ``bases``, named as the gateway
    names them, in the reply's order (vLLM's: the order they were loaded in)."""
    data = reply.get("data") if isinstance(reply, dict) else None
    out = []
    for card in data if isinstance(data, list) else []:
        if not isinstance(card, dict):
            continue
        name, parent, root = card.get("id"), card.get("parent"), card.get("root")
        if not (isinstance(name, str) and isinstance(parent, str) and parent in bases):
            continue
        if (parsed := parse_adapter_name(name)) is None:
            continue
        family, version = parsed
        out.append(Adapter(base=parent, version=version,
                           path=root if isinstance(root, str) else "",
                           model="" if family == parent else family))
    return out


def _in_order(found: list[Adapter]) -> list[Adapter]:
    if all(a.version.isdigit() for a in found):
        return sorted(found, key=lambda a: int(a.version))
    return found


async def adopt(rt: Runtime, b: Backend, models_reply: object,
                session: aiohttp.ClientSession) -> str | None:
    """Take over what static backend ``b`` holds (module docstring), asking the engines
    over ``session`` (the health checks'); None when it may be admitted, else why not."""
    if b.source != "static":
        return None
    label, _ = await engines.weight_label(session, b.url, TIMEOUT_S)
    if label == engines.UNLABELLED:  # never told a version: it says nothing
        label = None
        if rt.version_adopted or rt.weight_version != rt.settings.weight_version:
            log.warning("backend %s (%s) has no weight label (an engine restarted?) while "
                        "the gateway is at version %r: its calls are stamped %r; if it "
                        "does not serve those weights, update it or remove it", b.id, b.url,
                        rt.weight_version, rt.weight_version)
    if label is not None:
        b.weight_version = label
        _adopt_version(rt, b, label)
    found = adapter_cards(models_reply, b.models)
    if _adopt_adapters(rt, b, found, label):
        await _spread(rt, b, session)
    return await _load_missing(rt, b, {a.name for a in found}, session)


def _adopt_version(rt: Runtime, b: Backend, label: str) -> None:
    if not rt.version_adopted and rt.weight_version == rt.settings.weight_version:
        rt.version_adopted = True  # the first label read, before any update here
        if label != rt.weight_version:
            previous, rt.weight_version = rt.weight_version, label
            rt.events.emit("weight_version", f"weight version {previous} -> {label}: the "
                           f"label {b.id} serves (a gateway started over running engines)",
                           previous=previous, version=label, backend=b.id)
        return
    rt.version_adopted = True
    # the base weights' version: the gateway's, or what it was when adapters came
    expected = next((rt.adapters.base_versions[m] for m in sorted(b.models)
                     if m in rt.adapters.base_versions), rt.weight_version)
    if label != expected:
        log.warning("backend %s (%s) serves weight version %r, the gateway's is %r: its "
                    "calls are stamped %r until a weight update brings it to the gateway's",
                    b.id, b.url, label, expected, label)


def _adopt_adapters(rt: Runtime, b: Backend, found: list[Adapter],
                    label: str | None) -> list[str]:
    """Take ``found`` into the table; the families whose current adapter changed."""
    families: dict[str, list[Adapter]] = {}
    for a in found:
        families.setdefault(a.family, []).append(a)
    changed = []
    for family, adapters in families.items():
        known = rt.adapters.loaded(family)
        if known and family not in rt.adapters.adopted:
            continue  # an update this gateway ran decided what the family runs on
        adapters = _in_order([*known, *(a for a in adapters
                                        if a.version not in {k.version for k in known})])
        base, current, previous = adapters[0].base, adapters[-1], rt.version_of(family)
        if known and known[-1].version == current.version:
            continue
        if not any(a.base == base for a in rt.adapters):
            rt.adapters.base_versions[base] = label or rt.weight_version
        for a in adapters:
            rt.adapters.activate(a, keep=len(adapters))
        rt.adapters.adopted.add(family)
        if family == base:
            rt.weight_version = current.version
        changed.append(family)
        rt.events.emit("weight_version", f"LoRA adapters of {family} found on {b.id}: "
                       f"{', '.join(a.version for a in adapters)}; calls run on "
                       f"{current.name}", model=family, previous=previous,
                       version=current.version, adapter=current.name, backend=b.id)
    return changed


async def _held(b: Backend, session: aiohttp.ClientSession) -> set[str] | None:
    """The adapter names ``b`` lists now (None: it did not answer)."""
    error, reply = await engines.control(session, b.url, "GET", "/v1/models", TIMEOUT_S)
    return None if error is not None else {a.name for a in adapter_cards(reply, b.models)}


async def _load_missing(rt: Runtime, b: Backend, held: set[str],
                        session: aiohttp.ClientSession) -> str | None:
    """Each family's current adapter, loaded on ``b`` where it lacks it (calls are sent
    to it on that name); None, or why it could not."""
    for family in dict.fromkeys([*rt.adapters.families, *sorted(b.models)]):
        adapter = rt.adapters.current(family)
        if adapter is None or adapter.name in held or adapter.base not in b.models:
            continue
        error = await engines.load_adapter(session, b.url, adapter.name, adapter.path,
                                           TIMEOUT_S)
        if error is not None:
            return f"could not load LoRA adapter {adapter.name!r} it lacks: {error}"
        held.add(adapter.name)
        log.info("backend %s (%s) lacked LoRA adapter %s: loaded", b.id, b.url, adapter.name)
    return None


async def _spread(rt: Runtime, b: Backend, session: aiohttp.ClientSession) -> None:
    """A newer adapter found on ``b``: the static backends admitted before it get it too
    (one that cannot load it leaves rotation until its next check)."""
    for other in rt.registry:
        if other is b or other.source != "static" or not other.healthy:
            continue
        held = await _held(other, session)
        why = ("/v1/models did not answer" if held is None
               else await _load_missing(rt, other, held, session))
        if why is not None:
            other.healthy, other.last_error = False, why[:300]
            log.warning("backend %s (%s) leaves rotation: %s", other.id, other.url, why)
