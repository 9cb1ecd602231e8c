"""The LoRA adapters calls are served on, by the model name calls ask for.

A model name a harness sends names a *policy*: the served base model itself, or a LoRA
family declared on a base (``ROLLOUT_GATEWAY_LORA_MODELS="solver=qwen3-8b,verifier=qwen3-8b"``,
or created by its first LoRA update with ``model``). Several families of one base share
its engines: each request names the adapter it runs on, so a solver and a verifier can
be trained at once, even within one trajectory, on one pool.

A LoRA weight update (``gateway.weights.lora``) loads an adapter on every engine under a
name of its own (:func:`adapter_name`) and makes it its family's *current* adapter: a
call for the family is sent to the engines as a call on that name when it is
dispatched, and its tokens are stamped with the adapter's version. No engine is paused:
a call that started on the previous adapter finishes on it, under its own version. A
family without an adapter yet runs on its base's weights (what a LoRA run starts from).

Each family has its own weight version (its current adapter's; the base's own before
its first adapter) and may have its own staleness bound (``gateway.runtime``).

The adapters before the current one stay loaded while a call may still run on them: the
``keep`` most recent (a staleness bound of ``s`` versions needs ``s + 1``, as TRL's LoRA
path keeps ``max_staleness + 1``); older ones are unloaded from the engines.

Below the runtime, like :mod:`gateway.live_calls`: the relay reads it when it dispatches a
call, the weight-update control plane changes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


def adapter_name(model: str, version: str) -> str:
    """The name engines serve ``model``'s adapter of ``version`` under (a chat request's
    ``model``); vLLM refuses a name that is a served base model's."""
    return f"{model}@lora-{version}"


def parse_adapter_name(name: str) -> tuple[str, str] | None:
    """(family, version) of a name :func:`adapter_name` made; None for any other name."""
    family, sep, version = name.partition("@lora-")
    return (family, version) if sep and family and version and "@" not in family else None


@dataclass(frozen=True, slots=True)
class Adapter:
    base: str  # the served base model it applies to
    version: str  # the weight version calls on it are stamped with
    path: str  # the adapter's directory (adapter_config.json, adapter weights)
    rank: int | None = None  # ``r`` in its adapter_config.json
    model: str = ""  # the family (the model name calls ask for); "" is the base's own

    @property
    def family(self) -> str:
        return self.model or self.base

    @property
    def name(self) -> str:
        return adapter_name(self.family, self.version)

    def to_dict(self) -> dict[str, object]:
        return {"model": self.family, "base": self.base, "version": self.version,
                "name": self.name, "path": self.path, "rank": self.rank}


@dataclass(slots=True)
class Adapters:
    """Per family, its adapters loaded on the engines, oldest first; the last is the
    current one (what new calls are served on). ``families``: the LoRA families named
    apart from their base (model name -> base model)."""

    _loaded: dict[str, list[Adapter]] = field(default_factory=dict)
    families: dict[str, str] = field(default_factory=dict)
    #: each base's weight version when its first adapter was loaded: the weights its
    #: families run on before their first adapter (fixed while adapters are loaded)
    base_versions: dict[str, str] = field(default_factory=dict)
    #: families whose adapters were found on engines a restarted gateway took over
    #: (``gateway.weights.adopt``), not loaded by an update this gateway ran
    adopted: set[str] = field(default_factory=set)

    def declare(self, model: str, base: str) -> None:
        """``model`` is a LoRA family of ``base`` (served on the base's weights until its
        first adapter)."""
        if model == base:
            return
        known = self.families.get(model)
        if known is not None and known != base:
            raise ValueError(f"model {model!r} is a LoRA family of {known!r}, not {base!r}")
        self.families[model] = base

    def base_of(self, model: str) -> str | None:
        """The base model a LoRA family runs on (None: ``model`` is no declared family)."""
        return self.families.get(model)

    def current(self, model: str) -> Adapter | None:
        loaded = self._loaded.get(model)
        return loaded[-1] if loaded else None

    def loaded(self, model: str) -> list[Adapter]:
        return list(self._loaded.get(model, ()))

    def __iter__(self) -> Iterator[Adapter]:
        """Every adapter loaded, each family's oldest first."""
        for adapters in self._loaded.values():
            yield from adapters

    def __bool__(self) -> bool:
        return any(self._loaded.values())

    def activate(self, adapter: Adapter, keep: int) -> list[Adapter]:
        """``adapter`` is loaded on every engine and becomes its family's current one; the
        ones past the ``keep`` most recent leave the table and are returned (for the
        caller to unload from the engines)."""
        if keep < 1:
            raise ValueError("keep must be at least 1 (the current adapter)")
        if adapter.model:
            self.declare(adapter.model, adapter.base)
        loaded = [a for a in self._loaded.get(adapter.family, ())
                  if a.version != adapter.version]
        loaded.append(adapter)
        self._loaded[adapter.family] = loaded[-keep:]
        return loaded[:-keep]

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            family: {"base": adapters[-1].base if adapters else self.families.get(family),
                     "current": adapters[-1].to_dict() if adapters else None,
                     "loaded": [a.version for a in adapters]}
            for family, adapters in self._loaded.items()}
        for family, base in self.families.items():
            out.setdefault(family, {"base": base, "current": None, "loaded": []})
        return out
