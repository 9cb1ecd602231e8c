"""Routed experts kept in append-only segment files beside the database (docs/moe.md).

Routes are ~50 times the bytes of the tokens they describe. In Postgres rows they left the
trace writer a ninth to a fifth of its rate (the WAL and the table each take every byte;
docs/moe.md), a third of what these files leave it on the same disk.
Here the writer appends a batch's routes to a segment file and flushes it to disk
(``fdatasync``) before the batch's rows commit; the rows hold only ``(segment, offset,
length)``, so a row never points at bytes that are not on disk. A crash between the two
leaves unreferenced bytes in a segment, never a reference to nothing.

Each segment has one owner: the process that created it (``O_EXCL``) is the only one
that appends to it, and it opens a new segment rather than reopen an old one (after a
restart, or once its segment holds :attr:`RouteFiles.segment_bytes` or is
:attr:`RouteFiles.segment_age_s` old). Its name starts with its creation time in
milliseconds, so the retention (:mod:`gateway.store.retention`) knows from the name alone
that no process appends to it any more and that everything in it is older than a cutoff:
freeing routes deletes whole files, no vacuum. Readers (samples, the viewer, export) open
segments by name under the same directory: every process of one gateway (its shards) must
see the same directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".routes"
#: a segment takes appends until it holds this many bytes
SEGMENT_BYTES = 256 * 1024**2
#: ... or until it is this old (seconds): the retention deletes whole segments
SEGMENT_AGE_S = 600.0


@dataclass(frozen=True, slots=True)
class RouteRef:
    """Where one call's routes (a ``.npy``) lie: ``length`` bytes at ``offset`` of
    ``segment`` (a file name in the store's directory)."""

    segment: str
    offset: int
    length: int


def default_routes_dir(database_url: str) -> Path:
    """Beside an SQLite file (``gateway.db`` -> ``gateway.db.routes/``); for another
    database, ``~/.cache/rollout-gateway/routes/<hash of its URL>/``."""
    from sqlalchemy.engine import make_url

    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(str(url.database)).resolve().with_name(
            Path(str(url.database)).name + ".routes")
    digest = hashlib.sha256(database_url.encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "rollout-gateway" / "routes" / digest


def created_at(segment: str) -> float | None:
    """A segment's creation time (epoch seconds) from its name; None for another file."""
    if not segment.endswith(SUFFIX):
        return None
    head = segment.split("-", 1)[0]
    return int(head) / 1000 if head.isdigit() else None


class RouteFiles:
    """The segment directory of one store, and the segment this process appends to.

    :meth:`append`, :meth:`write` and :meth:`read` block (file I/O): call them from a
    thread. Space is reserved under a lock (the trace writer and the retention's copies
    share a segment), then written with positioned writes, so a batch's bytes can go to
    disk while the next step runs."""

    def __init__(self, root: Path, *, segment_bytes: int = SEGMENT_BYTES,
                 segment_age_s: float = SEGMENT_AGE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.segment_bytes = segment_bytes
        self.segment_age_s = segment_age_s
        self.clock = clock
        self._lock = threading.Lock()
        self._name = ""  # the segment this process appends to ("": none yet)
        self._size = 0
        self._opened = 0.0

    def append(self, blobs: Sequence[bytes]) -> list[RouteRef]:
        """Write ``blobs`` one after another and flush them to disk; where each lies.
        Raises ``OSError`` (a full or read-only disk): then none of them is referenced."""
        refs = self.reserve([len(b) for b in blobs])
        self.write(refs, blobs)
        return refs

    def reserve(self, lengths: Sequence[int]) -> list[RouteRef]:
        """Where blobs of ``lengths`` bytes will lie, one after another in this process's
        segment (a new one when it is full or old); :meth:`write` puts them there. Space
        reserved and never written is a hole no reference points at."""
        with self._lock:
            if not self._name or self._size >= self.segment_bytes or \
                    self.clock() - self._opened >= self.segment_age_s:
                self._roll()
            refs = []
            for n in lengths:
                refs.append(RouteRef(self._name, self._size, n))
                self._size += n
            return refs

    def write(self, refs: Sequence[RouteRef], blobs: Sequence[bytes]) -> None:
        """Write ``blobs`` where :meth:`reserve` placed them and flush them to disk
        (blocking). Raises ``OSError``; the references must then not be stored."""
        if not refs:
            return
        fd = os.open(self.root / refs[0].segment, os.O_WRONLY)
        try:
            for ref, blob in zip(refs, blobs, strict=True):
                view, at = memoryview(blob), ref.offset
                while view:
                    n = os.pwrite(fd, view, at)
                    view, at = view[n:], at + n
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(self, ref: RouteRef) -> bytes | None:
        """The bytes at ``ref``; None when its segment is gone (the retention deleted it)
        or holds fewer bytes than the reference says."""
        if "/" in ref.segment or ref.segment in ("", ".", ".."):
            return None
        try:
            with open(self.root / ref.segment, "rb", buffering=0) as f:
                data = os.pread(f.fileno(), ref.length, ref.offset)
        except FileNotFoundError:
            return None
        return data if len(data) == ref.length else None

    def segments(self) -> list[tuple[str, float]]:
        """Every segment in the directory with its creation time, oldest first."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = [(n, t) for n in names if (t := created_at(n)) is not None]
        return sorted(found, key=lambda s: s[1])

    def sealed_before(self, cutoff: float) -> list[str]:
        """Segments that take no more appends and hold only what was written before
        ``cutoff``: created at least :attr:`segment_age_s` before it (a process rolls
        over to a new segment before it appends to one that old)."""
        return [n for n, t in self.segments() if t + self.segment_age_s < cutoff]

    def delete(self, segment: str) -> None:
        with self._lock:
            if segment == self._name:  # sealed by age: the next append opens another
                self._name = ""
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / segment)

    def _roll(self) -> None:
        """A new segment of this process's own: created empty, exclusively (no other
        process ever writes to it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            now = self.clock()
            name = f"{int(now * 1000):013d}-{secrets.token_hex(4)}{SUFFIX}"
            try:
                fd = os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            os.close(fd)
            break
        self._name, self._size, self._opened = name, 0, now
