"""The pool's current weights, and the check a checkpoint passes before any engine is
paused for it.

:class:`Weights` is the one record of what every engine of the pool must serve: a
version and either a checkpoint path (engines reload it; engines started later load it
at start) or ``pushed`` weights that only the trainer holds (engines started later are
not admitted until an update brings them the weights).

:func:`check_checkpoint` refuses what vLLM could not load. vLLM's
``reload_weights(weights_path=...)`` points the model config at the path and lists its
weight files; a path that is missing, unreadable or holds no weights makes the worker
raise, which kills the engine core (``EngineDeadError``). A start on the path also
needs its ``config.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

#: weight files vLLM's default loader takes (safetensors first, then PyTorch)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True, slots=True)
class Weights:
    """What the pool serves: ``version``, held at ``path`` (None: the launcher's model),
    or ``pushed`` by the trainer into the engines (no path holds them)."""

    version: str
    path: str | None = None
    pushed: bool = False

    def describe(self) -> str:
        where = ("pushed by the trainer (no path holds them)" if self.pushed
                 else self.path or "the launcher's model")
        return f"version {self.version!r} from {where}"

    def to_dict(self) -> dict[str, object]:
        return {"version": self.version, "path": self.path, "pushed": self.pushed}


def check_checkpoint(path: str) -> list[str]:
    """Why vLLM could not load ``path`` (empty if it can): a readable directory with a
    ``config.json`` and weight files, every shard its index names present. Blocking
    (file system); run it in a thread."""
    p = Path(path)
    if not p.is_absolute():
        return [f"weights_path {path!r} is not absolute (engines resolve it in their own "
                "working directory)"]
    if not p.is_dir():
        return [f"weights_path {path!r} " + ("is not a directory" if p.exists()
                                             else "does not exist")]
    if not os.access(p, os.R_OK | os.X_OK):
        return [f"weights_path {path!r} is not readable"]
    problems = []
    if not (p / "config.json").is_file():
        problems.append(f"{path}: no config.json (an engine started on it needs one)")
    weights = [f for pattern in WEIGHT_PATTERNS for f in p.glob(pattern)]
    if not weights:
        problems.append(f"{path}: no weight files ({', '.join(WEIGHT_PATTERNS)})")
    unreadable = [f.name for f in weights if not os.access(f, os.R_OK)]
    if unreadable:
        problems.append(f"{path}: unreadable weight files {sorted(unreadable)[:5]}")
    for name in INDEX_FILES:
        problems += _missing_shards(p, name)
    return problems


def _missing_shards(p: Path, name: str) -> list[str]:
    index = p / name
    if not index.is_file():
        return []
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"{index}: unreadable index ({exc})"]
    missing = sorted(s for s in shards if not (p / str(s)).is_file())
    return [f"{index}: missing shards {missing[:5]}"] if missing else []
