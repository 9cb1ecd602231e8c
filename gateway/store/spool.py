"""A local spool file for trace records the database could not take (yet).

When the database is unreachable, the writer moves records from memory to this
append-only JSON-lines file (off the event loop) and replays it once the database is
back, including after a restart. Past ``max_bytes`` the spool refuses records (the writer
then holds them in memory).

One process owns a spool file: it holds an exclusive lock on ``<name>.lock`` from open to
close, so two processes (the shards of ``serve --shards``, two gateways on one database)
never append to, replay or delete each other's records. Without a configured path each
process takes the first free *slot* of its database's spool directory
(``~/.cache/rollout-gateway/spool/<hash of DATABASE_URL>[.sN].jsonl``): a restarted
process finds its predecessor's file again, and a file no live process holds (an
*orphan*: a shard that stopped for good) is adopted and replayed by the next process
that starts. A configured path (``TRACES__SPOOL_PATH``) held by a live process is an
error at start-up that says so.

Nothing the file holds stops a replay: a line that does not decode (corrupt, torn, a
field this version does not know) goes to the quarantine (:mod:`gateway.store.quarantine`)
and the replay moves past it. An append that fails (a full or read-only disk) leaves no
partial line behind: the file is cut back to where it was, or, when even that fails, the
next append starts on a new line so the fragment stays one undecodable line.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson

from gateway.loops import ERROR_EVERY_S, RateLimit
from gateway.store.quarantine import Quarantine
from gateway.store.records import CallRecord

log = logging.getLogger(__name__)
MAX_SLOTS = 64  #: processes on one database and machine that get a spool of their own


class SpoolBusy(RuntimeError):
    """The spool file is owned (locked) by another live process."""


def spool_dir() -> Path:
    return Path.home() / ".cache" / "rollout-gateway" / "spool"


def default_spool_path(database_url: str, slot: int = 0) -> Path:
    """Slot ``slot`` of the spool for ``database_url`` (see the module docstring)."""
    digest = hashlib.sha256(database_url.encode()).hexdigest()[:16]
    return spool_dir() / (f"{digest}.jsonl" if slot == 0 else f"{digest}.s{slot}.jsonl")


@dataclass(slots=True)
class Appended:
    """What became of the records given to :meth:`Spool.append`: ``kept`` of them are in
    the file; ``quarantined`` could not be encoded; ``refused`` (encodable, in their
    order) did not fit or could not be written."""

    kept: int = 0
    quarantined: list[CallRecord] = field(default_factory=list)
    refused: list[CallRecord] = field(default_factory=list)
    error: str | None = None  # why the refused ones were refused


class Spool:
    """Blocking file operations: call them through ``asyncio.to_thread``.

    They take turns (a lock): a thread a cancelled task left running still finishes its
    append before the next operation, so two never interleave in the file. Raises
    :class:`SpoolBusy` when another process holds the file."""

    def __init__(self, path: Path, max_bytes: int, *, quarantine: Quarantine | None = None
                 ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.quarantine = quarantine or Quarantine(path.parent / "quarantine" / path.name)
        self._lock = threading.Lock()
        self._offset_path = path.with_suffix(".offset")
        self._owner: int | None = _acquire(path.with_suffix(".lock"))
        self._new_line = False  # a failed append left a fragment: start the next on a new line
        self._offset_log = RateLimit(ERROR_EVERY_S)
        self.size = path.stat().st_size if path.exists() else 0
        self.offset = _saved_offset(self._offset_path)
        if self.offset > self.size:
            self.offset = 0
        self._cut_torn_tail()

    @property
    def pending_bytes(self) -> int:
        return self.size - self.offset

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Give the file up (another process may take it from now on)."""
        with self._lock:
            if self._owner is not None:
                os.close(self._owner)  # closing the descriptor releases the lock
                self._owner = None

    def discard(self) -> None:
        """Delete the (replayed) file and give it up: an orphan's end."""
        with self._lock:
            if not self.pending_bytes:
                self.path.unlink(missing_ok=True)
                self._offset_path.unlink(missing_ok=True)
        self.close()

    def append(self, records: Sequence[CallRecord]) -> Appended:
        """Append what can be encoded and fits under ``max_bytes`` (see :class:`Appended`)."""
        with self._lock:
            return self._append(records)

    def _encode(self, records: Sequence[CallRecord], out: Appended
                ) -> list[tuple[CallRecord, bytes]]:
        lines = []
        for rec in records:
            try:
                lines.append((rec, orjson.dumps(rec) + b"\n"))
            except (TypeError, ValueError, RecursionError) as exc:
                self.quarantine.record("unencodable", f"{type(exc).__name__}: {exc}", rec)
                out.quarantined.append(rec)
        return lines

    def _append(self, records: Sequence[CallRecord]) -> Appended:
        out = Appended()
        lines = self._encode(records, out)
        budget = self.max_bytes - self.size
        fits = 0
        for _, line in lines:
            if len(line) > budget:
                break
            budget -= len(line)
            fits += 1
        if fits < len(lines):
            out.error = f"spool full ({self.max_bytes} bytes)"
        if fits:
            data = (b"\n" if self._new_line else b"") + b"".join(ln for _, ln in lines[:fits])
            try:
                self._write(data)
            except OSError as exc:
                out.error = f"spool write failed: {exc}"
                fits = 0
        out.kept = fits
        out.refused = [rec for rec, _ in lines[fits:]]
        return out

    def _write(self, data: bytes) -> None:
        """Append ``data`` durably, or raise with the file as it was (see the module doc)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:  # unbuffered: a failure leaves nothing held back to flush
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            self._undo(fd)
            raise
        finally:
            os.close(fd)
        self.size += len(data)
        self._new_line = False

    def _undo(self, fd: int) -> None:
        try:
            os.ftruncate(fd, self.size)
        except OSError:
            self.size = os.fstat(fd).st_size  # the fragment stays, as one line
            self._new_line = True

    def read(self, limit: int) -> tuple[list[CallRecord], int]:
        """Up to ``limit`` records from the replay position, and the position after them.

        The position is past the replay position whenever bytes are pending: lines that do
        not decode are quarantined and skipped, so a replay always ends."""
        with self._lock:
            return self._read(limit)

    def _read(self, limit: int) -> tuple[list[CallRecord], int]:
        records: list[CallRecord] = []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            pos = self.offset
            for line in fh:
                pos += len(line)
                if not line.endswith(b"\n"):  # a fragment no later append completed
                    self.quarantine.line("torn_line", "the spool's last line is incomplete",
                                         line)
                    self._new_line = True
                    break
                rec = self._decode(line)
                if rec is not None:
                    records.append(rec)
                    if len(records) >= limit:
                        break
        return records, pos

    def _decode(self, line: bytes) -> CallRecord | None:
        if line == b"\n":
            return None  # the separator an append puts after a fragment
        try:
            data = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            self.quarantine.line("corrupt_line", f"not JSON: {exc}", line)
            return None
        if not isinstance(data, dict):
            self.quarantine.line("corrupt_line", "not a JSON object", line)
            return None
        try:
            return CallRecord(**data)
        except TypeError as exc:
            kind = "unknown_field" if "unexpected keyword" in str(exc) else "corrupt_line"
            self.quarantine.line(kind, str(exc), line)
            return None

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
            try:
                self.path.unlink(missing_ok=True)
                self._offset_path.unlink(missing_ok=True)
            except OSError as exc:  # a read-only disk: the file stays, all of it replayed
                log.warning("could not delete the replayed spool %s (%s)", self.path, exc)
                self._save_offset()
                return
            self.size = self.offset = 0
            self._new_line = False
            return
        self._save_offset()

    def _save_offset(self) -> None:
        """Save the replay position for the next owner. Unsaved (a full or read-only
        disk), the next owner replays from an earlier one: its records are stored once
        (inserts are idempotent by call id), so this only costs time."""
        try:
            self._offset_path.write_text(str(self.offset))
        except OSError as exc:
            if self._offset_log.ready(time.monotonic()):
                log.warning("could not save the spool's replay position (%s)", exc)

    def _cut_torn_tail(self) -> None:
        """A file an earlier owner left mid-append (a kill, a full disk) ends in a fragment:
        quarantine it and cut it off, so appends start on a line of their own."""
        if self.size == 0 or self.size == self.offset:
            return
        with self.path.open("rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) == b"\n":
                return
            end = _last_newline(fh, self.size, floor=self.offset)
            fh.seek(end)
            self.quarantine.line("torn_line", "the spool ended mid-line (a stop during an "
                                 "append)", fh.read())
            try:
                fh.truncate(end)
                self.size = end
            except OSError:
                self._new_line = True


def _saved_offset(path: Path) -> int:
    """The replay position an earlier owner saved; 0 (replay it all: inserts are
    idempotent) when there is none or it is unreadable."""
    try:
        return max(0, int(path.read_text()))
    except (OSError, ValueError):
        return 0


def _last_newline(fh: IO[bytes], size: int, *, floor: int) -> int:
    """The position just after the file's last newline at or after ``floor`` (else
    ``floor``), searched backwards in blocks."""
    pos = size
    while pos > floor:
        start = max(floor, pos - 65536)
        fh.seek(start)
        block = fh.read(pos - start)
        at = block.rfind(b"\n")
        if at >= 0:
            return start + at + 1
        pos = start
    return floor


def _acquire(lock_path: Path) -> int:
    """The lock file's descriptor, exclusively locked, or :class:`SpoolBusy`. Opened for
    reading only (a lock needs no more), so the disk can still be remounted read-only."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = lock_path.read_text().strip() or "unknown"
        raise SpoolBusy(f"the spool {lock_path.with_suffix('.jsonl')} is in use by another "
                        f"process (pid {holder}); give each gateway process its own "
                        "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH") from None
    with contextlib.suppress(OSError):  # who holds it, for that message
        lock_path.write_text(str(os.getpid()))
    return fd


def open_spools(database_url: str, configured: Path | None, max_bytes: int
                ) -> tuple[Spool, list[Spool]]:
    """This process's spool, and the orphans it adopts (files of the same database no live
    process holds, to replay and delete). ``configured``: the one path to use."""
    if configured is not None:
        return Spool(configured, max_bytes), []
    own: Spool | None = None
    orphans: list[Spool] = []
    for slot in range(MAX_SLOTS):
        path = default_spool_path(database_url, slot)
        exists = path.exists()
        if own is not None and not exists:
            continue
        try:
            spool = Spool(path, max_bytes)
        except SpoolBusy:
            continue
        if own is None:
            own = spool
        elif spool.pending_bytes:
            orphans.append(spool)
        else:
            spool.discard()
    if own is None:
        raise SpoolBusy(f"all {MAX_SLOTS} spool slots of this database in {spool_dir()} are "
                        "in use; set ROLLOUT_GATEWAY_TRACES__SPOOL_PATH")
    return own, orphans


def close_quietly(spools: Sequence[Spool]) -> None:
    for spool in spools:
        with contextlib.suppress(OSError):
            spool.close()
