"""Model aliases: a harness's own model names mapped to a model the pool serves.

Coding-agent CLIs ask for the vendor's model names (Claude Code: ``claude-opus-*``,
``claude-haiku-*`` for its side calls; Codex CLI: ``gpt-5*``) unless every one of their
model settings is overridden. ``ROLLOUT_GATEWAY_MODEL_ALIASES`` maps such names to a
served model so the harness runs with nothing set but its base URL and key.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from fnmatch import fnmatchcase

_GLOB = frozenset("*?[")


def resolve_model(aliases: Mapping[str, str], name: str, served: Collection[str] = ()) -> str:
    """The model to run for a call that asked for ``name``.

    In order: an alias whose key is exactly ``name``; ``name`` itself when the pool
    serves it (a glob never redirects a served model); the first glob key (``*``, ``?``,
    ``[...]``, matched case-sensitively, in the order the setting lists them) that
    matches; else ``name`` unchanged (the usual 404 for an unknown model follows).
    ``*`` alone, listed last, is the fallback for every other name.
    """
    exact = aliases.get(name)
    if exact is not None:
        return exact
    if name in served:
        return name
    for pattern, target in aliases.items():
        if _GLOB.intersection(pattern) and fnmatchcase(name, pattern):
            return target
    return name

