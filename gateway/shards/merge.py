"""One ``/status`` and one ``/metrics`` from the shards' own (pure functions).

The merged status has the shape of one gateway's (docs/status-page.md), so the same page
draws it, plus ``shards``: each shard's URL, whether it answered, its weight version and
pause state. Counts and rates add up; instances and events are listed with their shard
(``s1/b0``); quantiles cannot be merged from quantiles, so latency shows the largest of
the shards' (marked ``"merged": "max"``), and trajectory lengths are merged bin by bin
with percentiles read off the merged bins (``"approximate": true``).

Metrics: every shard's samples, each labelled ``shard="i"``, under one ``# HELP`` and
``# TYPE`` per family; Prometheus sums them with ``sum without (shard)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

GANTT_ROWS = 12
EVENTS_SHOWN = 50


def _sum_dicts(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Numbers added key by key (nested dicts too); other values from the first part."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if isinstance(v, bool) or not isinstance(v, int | float | dict):
                out.setdefault(k, v)
            elif isinstance(v, dict):
                out[k] = _sum_dicts([out.get(k) or {}, v])
            else:
                out[k] = (out.get(k) or 0) + v
    return out


def _merge_writers(parts: Sequence[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The shards' trace writers (by shard) as one: counts added; recording (and the
    other flags) only when every shard's is; the first shard's reason where one has one,
    prefixed ``s<shard>:``."""
    out = _sum_dicts([p for _, p in parts])
    for flag in ("recording", "running", "db_ok"):
        out[flag] = all(p.get(flag, True) for _, p in parts)
    for reason in ("refusal", "failure", "spool_error", "last_error", "quarantine_file"):
        out[reason] = next((f"s{i}: {p[reason]}" for i, p in parts if p.get(reason)), None)
    return out


def _prefixed(shard: int, value: str | None) -> str | None:
    return None if value is None else f"s{shard}/{value}"


def _one(values: list[Any]) -> Any:
    """The shards' common value, or all of them when they differ."""
    distinct = list(dict.fromkeys(str(v) for v in values))
    return values[0] if len(distinct) == 1 else " | ".join(distinct)


def _merge_models(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each model's line (``/status`` ``models``): its facts the shards' common ones, its
    trajectories added up."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(n for part in parts for n in part):
        rows = [part[name] for part in parts if name in part]
        out[name] = {**{k: _one([r.get(k) for r in rows])
                        for k in ("base", "version", "adapter", "max_staleness", "share")},
                     "calls_running": sum(r.get("calls_running") or 0 for r in rows),
                     "trajectories": _sum_dicts([r.get("trajectories") or {} for r in rows])}
    return out


def merge_status(statuses: Sequence[dict[str, Any] | None],
                 urls: Sequence[str]) -> dict[str, Any]:
    """The merged ``/status``; ``None`` for a shard that did not answer."""
    up = [(i, s) for i, s in enumerate(statuses) if s is not None]
    shards = [{"shard": i, "url": urls[i], "ok": s is not None,
               **({"weight_version": s.get("weight_version"), "paused": s.get("paused"),
                   "policy": s.get("policy")} if s is not None else {})}
              for i, s in enumerate(statuses)]
    if not up:
        return {"shards": shards, "backends": [], "error": "no shard answered"}
    parts = [s for _, s in up]
    first = parts[0]
    backends = [{**b, "id": _prefixed(i, b["id"]), "shard": i}
                for i, s in up for b in s.get("backends", [])]
    return {
        "policy": _one([s.get("policy") for s in parts]),
        "policies": first.get("policies", []),
        "weight_version": _one([s.get("weight_version") for s in parts]),
        "models": _merge_models([s.get("models") or {} for s in parts]),
        "adapters": first.get("adapters"),
        "paused": any(s.get("paused") for s in parts),
        "backends": backends,
        "trajectories": _sum_dicts([s.get("trajectories", {}) for s in parts]),
        "scheduler": _sum_dicts([s.get("scheduler", {}) for s in parts]),
        "trace_writer": _merge_writers([(i, s.get("trace_writer", {})) for i, s in up]),
        "restore": _sum_dicts([s.get("restore", {}) for s in parts]),
        # trainers report to the first shard (the front forwards /training there)
        "training_mismatch": first.get("training_mismatch"),
        "relayouts": first.get("relayouts"),
        "speeds": first.get("speeds"),
        "server_time": max(s.get("server_time", 0.0) for s in parts),
        "started_at": min(s.get("started_at", 0.0) for s in parts),
        "pool": _sum_dicts([s.get("pool", {}) for s in parts]),
        "totals": _sum_dicts([s.get("totals", {}) for s in parts]),
        "rates": _sum_dicts([s.get("rates", {}) for s in parts]),
        "latency": {**{k: max((s.get("latency", {}).get(k) for s in parts
                               if s.get("latency", {}).get(k) is not None), default=None)
                       for k in first.get("latency", {})}, "merged": "max"},
        "gantt": merge_gantt([(i, s.get("gantt") or {}) for i, s in up]),
        "lengths": merge_lengths([s.get("lengths") or {} for s in parts]),
        "history": merge_history([s.get("history") or {} for s in parts]),
        "events": merge_events([(i, s.get("events") or []) for i, s in up]),
        "shards": shards,
    }


def merge_gantt(parts: Sequence[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The longest-running rows of all shards on one time axis (the earliest ``t0``)."""
    rows: list[tuple[float, dict[str, Any]]] = []  # (absolute start, row)
    now_abs = 0.0
    for i, g in parts:
        t0 = g.get("t0", 0.0)
        now_abs = max(now_abs, t0 + g.get("now", 0.0))
        rows += [(t0, {**r, "id": r["id"], "shard": i, "backend_id": _prefixed(
            i, r.get("backend_id"))}) for r in g.get("rows", [])]
    if not rows:
        return {"t0": now_abs, "now": 0.0, "rows": [], "relayouts": []}
    rows.sort(key=lambda tr: tr[1]["end"] - tr[1]["start"], reverse=True)
    kept = rows[:GANTT_ROWS]
    t0 = min(base + r["start"] for base, r in kept)

    def shift(base: float, r: dict[str, Any]) -> dict[str, Any]:
        d = base - t0
        return {**r, "start": round(r["start"] + d, 3), "end": round(r["end"] + d, 3),
                "segments": [[k, round(a + d, 3), round(b + d, 3)]
                             for k, a, b in r.get("segments", [])]}

    return {"t0": t0, "now": round(now_abs - t0, 3), "relayouts": [],
            "rows": [shift(base, r) for base, r in kept]}


def merge_lengths(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    bins: dict[tuple[int, int], int] = defaultdict(int)
    count = finished = 0
    total = 0.0
    top: int | None = None
    for p in parts:
        for b in p.get("bins", []):
            bins[(b["lo"], b["hi"])] += b["count"]
        count += p.get("count", 0)
        finished += p.get("finished", 0)
        total += (p.get("mean") or 0.0) * p.get("count", 0)
        if p.get("max") is not None:
            top = max(top or 0, p["max"])
    ordered = [{"lo": lo, "hi": hi, "count": c} for (lo, hi), c in sorted(bins.items())]

    def pct(q: float) -> int | None:
        need, seen = q * count, 0
        for b in ordered:
            seen += b["count"]
            if seen >= need and count:
                return min(int(b["hi"]), top or 0)
        return None

    return {"count": count, "finished": finished, "bins": ordered, "p50": pct(0.5),
            "p90": pct(0.9), "p99": pct(0.99), "max": top,
            "mean": round(total / count, 1) if count else None, "approximate": True}


def merge_history(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rate points added up by time slot (each shard samples on its own clock)."""
    interval = max((p.get("interval_s") or 0.0 for p in parts), default=0.0) or 1.0
    slots: dict[int, list[float]] = {}
    for p in parts:
        for t, *rates in p.get("points", []):
            slot = slots.setdefault(round(t / interval), [0.0] * len(rates))
            for k, r in enumerate(rates):
                slot[k] += r
    return {"interval_s": interval,
            "points": [[round(k * interval, 3), *(round(r, 3) for r in v)]
                       for k, v in sorted(slots.items())]}


def merge_events(parts: Sequence[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The newest events of all shards, newest first (as one gateway lists them)."""
    events = [{**e, "shard": i, "message": f"s{i}: {e.get('message', '')}"}
              for i, evs in parts for e in evs]
    events.sort(key=lambda e: e.get("ts") or 0.0, reverse=True)
    return events[:EVENTS_SHOWN]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def merge_metrics(texts: Sequence[str | None]) -> str:
    """Every shard's Prometheus text, each sample labelled with its shard."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for i, text in enumerate(texts):
        if text is None:
            continue
        for fam in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                labels = {**s.labels, "shard": str(i)}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{body}}} {s.value!r}")
    out = []
    for name, (kind, doc, lines) in families.items():
        out += [f"# HELP {name} {_escape(doc)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"
