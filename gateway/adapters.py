"""The LoRA adapters a base model's policy is served with: the current one and those kept.

A LoRA weight update (``gateway.weights.lora``) loads an adapter on every engine under a
name of its own (:func:`adapter_name`) and makes it the *current* adapter of its base
model: a call asking for the base model is sent to the engines as a call on that name
when it is dispatched, and its tokens are stamped with the adapter's version. Engines
serve a request on the adapter its ``model`` names, so no engine is paused: a call that
started on the previous adapter finishes on it, under its own version.

The adapters before the current one stay loaded while a call may still run on them: the
``keep`` most recent (a staleness bound of ``s`` versions needs ``s + 1``, as TRL's LoRA
path keeps ``max_staleness + 1``); older ones are unloaded from the engines.

Below the runtime, like :mod:`gateway.live_calls`: the relay reads it when it dispatches a
call, the weight-update control plane changes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


def adapter_name(base: str, version: str) -> str:
    """The name engines serve ``base``'s adapter of ``version`` under (a chat request's
    ``model``); vLLM refuses a name that is a served base model's."""
    return f"{base}@lora-{version}"


@dataclass(frozen=True, slots=True)
class Adapter:
    base: str  # the served base model it applies to
    version: str  # the weight version calls on it are stamped with
    path: str  # the adapter's directory (adapter_config.json, adapter weights)
    rank: int | None = None  # ``r`` in its adapter_config.json

    @property
    def name(self) -> str:
        return adapter_name(self.base, self.version)

    def to_dict(self) -> dict[str, object]:
        return {"base": self.base, "version": self.version, "name": self.name,
                "path": self.path, "rank": self.rank}


@dataclass(slots=True)
class Adapters:
    """Per base model, its adapters loaded on the engines, oldest first; the last is the
    current one (what new calls are served on)."""

    _loaded: dict[str, list[Adapter]] = field(default_factory=dict)

    def current(self, base: str) -> Adapter | None:
        loaded = self._loaded.get(base)
        return loaded[-1] if loaded else None

    def loaded(self, base: str) -> list[Adapter]:
        return list(self._loaded.get(base, ()))

    def __iter__(self) -> Iterator[Adapter]:
        """Every adapter loaded, each base's oldest first."""
        for adapters in self._loaded.values():
            yield from adapters

    def __bool__(self) -> bool:
        return any(self._loaded.values())

    def activate(self, adapter: Adapter, keep: int) -> list[Adapter]:
        """``adapter`` is loaded on every engine and becomes its base's current one; the
        ones past the ``keep`` most recent leave the table and are returned (for the
        caller to unload from the engines)."""
        if keep < 1:
            raise ValueError("keep must be at least 1 (the current adapter)")
        loaded = [a for a in self._loaded.get(adapter.base, ())
                  if a.version != adapter.version]
        loaded.append(adapter)
        self._loaded[adapter.base] = loaded[-keep:]
        return loaded[:-keep]

    def to_dict(self) -> dict[str, object]:
        return {base: {"current": adapters[-1].to_dict() if adapters else None,
                       "loaded": [a.version for a in adapters]}
                for base, adapters in self._loaded.items()}
