"""A local spool file for trace records the database could not take (yet).

When the database is unreachable, the writer moves records from memory to this
append-only JSON-lines file (off the event loop) and replays it once the database is
back, including after a restart. Past ``max_bytes`` the spool refuses records; the
writer counts them as dropped.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import orjson

from gateway.store.records import CallRecord


def default_spool_path(database_url: str) -> Path:
    digest = hashlib.sha256(database_url.encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "rollout-gateway" / "spool" / f"{digest}.jsonl"


class Spool:
    """Blocking file operations: call them through ``asyncio.to_thread``.

    They take turns (a lock): a thread a cancelled task left running still finishes its
    append before the next operation, so two never interleave in the file."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._offset_path = path.with_suffix(".offset")
        self.size = path.stat().st_size if path.exists() else 0
        self.offset = int(self._offset_path.read_text()) if self._offset_path.exists() else 0
        if self.offset > self.size:
            self.offset = 0

    @property
    def pending_bytes(self) -> int:
        return self.size - self.offset

    def append(self, records: Sequence[CallRecord]) -> int:
        """Append what fits under ``max_bytes``; returns how many records were kept."""
        with self._lock:
            return self._append(records)

    def _append(self, records: Sequence[CallRecord]) -> int:
        lines = [orjson.dumps(r) + b"\n" for r in records]
        kept = 0
        budget = self.max_bytes - self.size
        for line in lines:
            if len(line) > budget:
                break
            budget -= len(line)
            kept += 1
        if kept:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as fh:
                data = b"".join(lines[:kept])
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            self.size += len(data)
        return kept

    def read(self, limit: int) -> tuple[list[CallRecord], int]:
        """Up to ``limit`` records from the replay position, and the position after them."""
        with self._lock:
            return self._read(limit)

    def _read(self, limit: int) -> tuple[list[CallRecord], int]:
        records: list[CallRecord] = []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            pos = self.offset
            for line in fh:
                if not line.endswith(b"\n"):
                    break  # torn final write: leave it
                pos += len(line)
                records.append(CallRecord(**orjson.loads(line)))
                if len(records) >= limit:
                    break
        return records, pos

    def commit(self, position: int) -> None:
        """Records before ``position`` are in the database; forget them."""
        with self._lock:
            self._commit(position)

    def wait_idle(self) -> None:
        """Return once no other operation is under way."""
        with self._lock:
            pass

    def _commit(self, position: int) -> None:
        self.offset = position
        if self.offset >= self.size:
            self.path.unlink(missing_ok=True)
            self._offset_path.unlink(missing_ok=True)
            self.size = self.offset = 0
            return
        self._offset_path.write_text(str(self.offset))
