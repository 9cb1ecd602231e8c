"""A record per local engine, so that a restarted gateway finds what a dead one left.

The guard (:mod:`backends.engine_guard`) stops an engine when its gateway dies. Two
things it cannot cover: a guard that was killed itself, and a gateway restarted while
the old guard is still inside its grace period (the old engine still holds its GPUs).
So the launcher writes one JSON file per engine into a state directory (default
``~/.local/state/rollout-gateway/engines``), and before it starts its first engine it
reaps every engine on this host whose gateway is gone.

A record names the engine's tag, the owning gateway (pid and start time), the guard,
the port, the spec and the log. Its gateway counts as alive only if a process with that
pid *and* that start time exists, so a recycled pid does not keep an orphan alive; and
processes are found by the tag in their environment, never by a pid from the file, so
a recycled pid is never killed. Records of another host (a state directory on a shared
home) are left alone; records from before this machine's last boot are deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backends.base import InstanceSpec
from backends.engine_guard import start_ticks, stop_tagged, tagged

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def default_state_dir() -> Path:
    return Path.home() / ".local" / "state" / "rollout-gateway" / "engines"


def new_tag() -> str:
    return uuid.uuid4().hex[:16]


def _boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


@dataclass(slots=True)
class ProcessId:
    """One process for as long as the machine runs: pid plus start time."""

    pid: int
    start_ticks: int | None

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        return cls(pid, start_ticks(pid))

    def alive(self) -> bool:
        return self.start_ticks is not None and start_ticks(self.pid) == self.start_ticks


@dataclass(slots=True)
class EngineRecord:
    tag: str
    owner: ProcessId
    guard: ProcessId
    port: int
    spec: dict[str, Any]
    log_path: str | None = None
    host: str = field(default_factory=socket.gethostname)
    boot_id: str = field(default_factory=_boot_id)
    started_at: float = field(default_factory=time.time)

    @classmethod
    def new(cls, tag: str, guard_pid: int, port: int, spec: InstanceSpec,
            log_path: str | None) -> EngineRecord:
        return cls(tag=tag, owner=ProcessId.of(os.getpid()), guard=ProcessId.of(guard_pid),
                   port=port, spec=asdict(spec), log_path=log_path)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EngineRecord:
        return cls(**{**d, "owner": ProcessId(**d["owner"]), "guard": ProcessId(**d["guard"])})

    def describe(self) -> str:
        return (f"engine {self.spec.get('id')} (port {self.port}, tag {self.tag}) of gateway "
                f"pid {self.owner.pid}")


def record_path(state_dir: Path, tag: str) -> Path:
    return state_dir / f"{tag}.json"


def write_record(state_dir: Path, record: EngineRecord) -> Path:
    """Write atomically (a reader never sees half a record). Blocking."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = record_path(state_dir, record.tag)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    tmp.replace(path)
    return path


def remove_record(state_dir: Path, tag: str) -> None:
    with contextlib.suppress(OSError):
        record_path(state_dir, tag).unlink()


def _load(path: Path) -> EngineRecord | None:
    try:
        return EngineRecord.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


@dataclass(slots=True)
class Reaped:
    record: EngineRecord
    pids: list[int]  # the engine's processes found running
    left: list[int]  # those that would not die (the record is kept for the next try)


def reap_orphans(state_dir: Path, grace_s: float) -> list[Reaped]:
    """Stop every engine recorded in ``state_dir`` whose gateway is gone (SIGTERM, SIGKILL
    after ``grace_s``) and drop its record. Blocking; engines of live gateways stay."""
    if not state_dir.is_dir():
        return []
    host, boot, reaped = socket.gethostname(), _boot_id(), []
    for path in sorted(state_dir.glob("*.json")):
        record = _load(path)
        if record is None or (record.host == host and record.boot_id != boot):
            with contextlib.suppress(OSError):
                path.unlink()  # unreadable, or from before the last boot
            continue
        if record.host != host or record.owner.alive():
            continue
        pids = tagged(record.tag)
        left = stop_tagged(record.tag, grace_s) if pids else []
        if pids:
            reaped.append(Reaped(record, pids, left))
        if not left:
            with contextlib.suppress(OSError):
                path.unlink()
    return reaped
