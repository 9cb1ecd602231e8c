"""Where trace records go that can be neither written nor replayed: kept, counted, logged.

A record the database rejects (a constraint, a value its column cannot take), one that
cannot be encoded, a spool line that cannot be decoded (corrupt, torn by a kill or a full
disk, or carrying a field this version does not know) is never the reason the trace
writer stops, and never vanishes: it is appended to a JSON-lines file beside the spool
(``<spool dir>/quarantine/<spool name>``), counted by kind, and logged the first time a
kind occurs (then at most once a minute, with the count in between). An operator can read
the file, fix what made the records unwritable and feed them back.

Each line is ``{"at": epoch seconds, "kind": ..., "reason": ..., "record": {...}}`` for a
record, or ``"line": "<the spool line, as text>"`` for a line that did not decode. What
cannot even be written here (the disk is full too) is counted in ``lost``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import orjson

from gateway.loops import ERROR_EVERY_S, RateLimit
from gateway.store.records import CallRecord

log = logging.getLogger(__name__)

#: the kinds of quarantined records, as counted and exported
KINDS = ("rejected", "unencodable", "corrupt_line", "unknown_field", "torn_line",
         "writer_failure")
_SCALARS = [f.name for f in fields(CallRecord)
            if f.name not in {"prompt_delta", "completion_ids", "completion_logprobs",
                              "extra_choices", "request_messages", "weight_segments"}]


def _record_json(rec: CallRecord) -> Any:
    """The record as JSON-ready data, whatever it holds: in full when it encodes (orjson,
    then the standard library, which nests deeper), else its scalar fields and token ids
    with a note (a record nested past every encoder's limit still leaves its identity)."""
    try:
        return orjson.loads(orjson.dumps(rec))
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return json.loads(json.dumps(asdict(rec), default=repr))
    except (TypeError, ValueError, RecursionError):
        pass
    out: dict[str, Any] = {k: getattr(rec, k) for k in _SCALARS}
    out = json.loads(json.dumps(out, default=repr))
    out["prompt_delta"] = list(rec.prompt_delta)
    out["completion_ids"] = list(rec.completion_ids)
    out["note"] = "request_messages, extra_choices and weight_segments could not be encoded"
    return out


class Quarantine:
    """The quarantine file of one spool; thread-safe (the writer calls it from threads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: Counter[str] = Counter()
        self.lost = 0  # could not be written here either
        self._lock = threading.Lock()
        self._logs: dict[str, RateLimit] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, kind: str, reason: str, rec: CallRecord) -> None:
        self._put(kind, reason, {"record": _record_json(rec),
                                 "trajectory_id": rec.trajectory_id})

    def records(self, kind: str, reason: str, records: list[CallRecord]) -> None:
        for rec in records:
            self.record(kind, reason, rec)

    def line(self, kind: str, reason: str, raw: bytes) -> None:
        self._put(kind, reason, {"line": raw.decode(errors="replace")})

    def _put(self, kind: str, reason: str, payload: dict[str, Any]) -> None:
        entry = {"at": time.time(), "kind": kind, "reason": reason[:1000]} | payload
        with self._lock:
            self.counts[kind] += 1
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("ab") as fh:
                    fh.write(json.dumps(entry).encode() + b"\n")
            except OSError as exc:
                self.lost += 1
                reason = f"{reason}; and it could not be quarantined ({exc})"
            self._log(kind, reason)

    def _log(self, kind: str, reason: str) -> None:
        limit = self._logs.setdefault(kind, RateLimit(ERROR_EVERY_S))
        if limit.ready(time.monotonic()):
            held = limit.take_held()
            more = f" ({held} more since the last report)" if held else ""
            log.error("trace record quarantined (%s: %s)%s; %d %s in %s so far", kind,
                      reason[:300], more, self.counts[kind], kind, self.path)
