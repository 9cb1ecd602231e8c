"""Routed experts as stored: a call's pieces merged into one array, and their coverage.

A call keeps what its engine answered as ``[first position, base64 .npy]`` pieces
(:mod:`gateway.proxy.routes`); the trace writer merges them into one ``.npy`` of
``(positions, layers, top_k)`` expert ids (:func:`merge`), from position
``calls.routes_start`` of the call's prompt and completion, and puts it in a segment file
(:func:`place_routes`, :mod:`gateway.store.route_files`) or in ``calls.routes``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from gateway.loops import ERROR_EVERY_S, RateLimit
from gateway.store.records import CallRecord
from gateway.store.route_files import RouteFiles, RouteRef

log = logging.getLogger(__name__)
#: base64 characters enough for any ``.npy`` header this module reads (v1: 128 bytes)
_HEAD_CHARS = 344


def header(data: str) -> tuple[tuple[int, ...], np.dtype[Any]] | None:
    """The shape and dtype of vLLM's base64 ``.npy`` without decoding its body; None when
    it is not a 3-d array of unsigned expert ids."""
    try:
        raw = pybase64.b64decode(data[:_HEAD_CHARS - _HEAD_CHARS % 4], validate=True)
        buf = io.BytesIO(raw)
        version = np.lib.format.read_magic(buf)
        if version != (1, 0):
            return None
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
    except Exception:  # whatever the engine sent, it is not routes
        return None
    if fortran or len(shape) != 3 or dtype.kind != "u":
        return None
    return shape, dtype


def coverage(pieces: Sequence[Sequence[Any]]) -> tuple[int, int] | None:
    """``(start, end)``: the positions the pieces cover without a gap from the lowest
    start (None without a readable piece)."""
    spans = []
    for start, data in pieces:
        head = header(data) if isinstance(data, str) else None
        if head is not None:
            spans.append((int(start), int(start) + head[0][0]))
    if not spans:
        return None
    spans.sort()
    lo, hi = spans[0]
    for s, e in spans[1:]:
        if s > hi:
            break
        hi = max(hi, e)
    return lo, hi


def merge(pieces: Sequence[Sequence[Any]]) -> tuple[int, bytes] | None:
    """One array from a call's pieces: ``(first position, .npy bytes)`` of the positions
    covered without a gap from the lowest start (where pieces overlap, the piece that
    starts first keeps its rows). None when no piece decodes; never raises for a piece
    the engine sent wrong (the writer must not take it for a database fault)."""
    if len(pieces) == 1:  # the usual call: the engine's bytes as they are
        start, data = pieces[0]
        try:
            if header(data) is None:
                return None
            return int(start), pybase64.b64decode(data, validate=True)
        except Exception:  # a piece the engine sent wrong: none stored
            return None
    arrays: list[tuple[int, np.ndarray]] = []
    for start, data in pieces:
        try:
            arr = np.load(io.BytesIO(pybase64.b64decode(data, validate=True)),
                          allow_pickle=False)
            if arr.ndim == 3 and arr.dtype.kind == "u":
                arrays.append((int(start), arr))
        except Exception:  # an undecodable piece is left out
            continue
    if not arrays:
        return None
    arrays.sort(key=lambda p: p[0])
    lo, first = arrays[0]
    shape = first.shape[1:]
    end = lo + len(first)
    parts = [first]
    for s, arr in arrays[1:]:
        if s > end or arr.shape[1:] != shape:
            break
        if s + len(arr) > end:
            parts.append(arr[end - s:].astype(first.dtype, copy=False))
            end = s + len(arr)
    out = io.BytesIO()
    np.save(out, np.concatenate(parts) if len(parts) > 1 else first, allow_pickle=False)
    return lo, out.getvalue()


def place_routes(files: RouteFiles, records: Sequence[CallRecord]
                 ) -> tuple[list[RouteRef], list[bytes]]:
    """Merge each record's pieces and reserve their place in ``files`` (blocking: it may
    create a segment): each record gets its ``routes_ref`` instead of its pieces (none,
    when its pieces hold no readable routes). The references and the bytes to write
    there (:meth:`RouteFiles.write`). Raises ``OSError`` when no segment can be made
    (the records keep their pieces)."""
    merged = [merge(rec.routes) if rec.routes else None for rec in records]
    kept = [(rec, m) for rec, m in zip(records, merged, strict=True) if m is not None]
    blobs = [data for _, (_, data) in kept]
    refs = files.reserve([len(b) for b in blobs])
    for rec in records:
        rec.routes = None
    for (rec, (start, _)), ref in zip(kept, refs, strict=True):
        rec.routes_ref = [ref.segment, ref.offset, ref.length, start]
    return refs, blobs


@dataclass(slots=True)
class Placed:
    """A batch's routes placed in the segment files and being written there."""

    write: asyncio.Future[None]
    records: list[CallRecord]
    owner: RouteWriter

    async def landed(self) -> bool:
        """Whether the write put them on disk; if not, the records lose them (their
        tokens are written without)."""
        try:
            await self.write
        except OSError as exc:
            self.owner.refused(self.records, exc)
            return False
        return True


class RouteWriter:
    """The trace writer's routed experts on disk (:mod:`gateway.store.route_files`): a
    batch's are placed and written while its rows are, and the rows commit only once
    they have landed. Files that refuse them (a full or failing disk) lose them, counted
    and logged; the records' tokens are written whatever happens."""

    def __init__(self, files: RouteFiles) -> None:
        self.files = files
        self.unwritten = 0  # records whose routes the files could not take
        self._log = RateLimit(ERROR_EVERY_S)

    async def place(self, batch: Sequence[CallRecord]) -> Placed | None:
        """Give the routes of ``batch`` their place (each record's ``routes_ref``) and
        start writing them there; None when it has none (or no segment could be made)."""
        todo = [rec for rec in batch if rec.routes]
        if not todo:
            return None
        try:
            refs, blobs = await asyncio.to_thread(place_routes, self.files, todo)
        except OSError as exc:
            self.refused(todo, exc)
            return None
        write = asyncio.ensure_future(asyncio.to_thread(self.files.write, refs, blobs))
        return Placed(write, todo, self)

    def refused(self, records: Sequence[CallRecord], exc: OSError) -> None:
        for rec in records:
            rec.routes, rec.routes_ref = None, None
        self.unwritten += len(records)
        if self._log.ready(time.monotonic()):
            log.error("routed experts of %d calls not stored: the segment files in %s "
                      "refused them (%s); their tokens are kept", self.unwritten,
                      self.files.root, exc)


def to_field(arr: np.ndarray) -> str:
    """An array as the samples' ``routed_experts`` field: base64 of its ``.npy``."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return pybase64.b64encode(buf.getvalue()).decode()


def from_field(field: str) -> np.ndarray:
    """The array of a ``routed_experts`` field (:func:`to_field`)."""
    arr: np.ndarray = np.load(io.BytesIO(pybase64.b64decode(field, validate=True)),
                              allow_pickle=False)
    return arr
