"""What ``bench grid`` reports of its runs (shared by the runner and ``bench page``): each
cell's mean makespans, its best uniform static layout, every other policy's paired ratio
against it, the critical-path bound, and how many cells meet issue 30's bars."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.simulator.steps import paired_ratio

STATIC = tuple(f"verl-tp{t}" for t in (1, 2, 4, 8))
RIVALS = ("heddle", "libra", "straggler-lane")
SUBJECT = "replay"


@dataclass(frozen=True, slots=True)
class Cell:
    model: str
    gpu: str
    gpus: int
    per_gpu: int
    workload: str
    band: str

    @property
    def key(self) -> str:
        return (f"{self.model}/{self.gpu}/{self.gpus}gpu/{self.per_gpu}pg/{self.workload}/"
                f"{self.band}")


def _per_seed(doc: dict[str, Any], cell: Cell, policy: str,
              steps: slice = slice(1, None)) -> dict[str, float] | None:
    """Per seed, the mean makespan over ``steps`` (by default 2..K: step 1 is cold)."""
    out: dict[str, float] = {}
    for s in doc["seeds"]:
        r = doc["runs"].get(f"{cell.key}|{policy}|{s}")
        if r is None or "infeasible" in r:
            return None
        ms = r["makespans"][steps] or r["makespans"]
        out[str(s)] = statistics.fmean(ms)
    return out


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Per cell: mean makespan per policy, the best static layout, and each non-static
    policy's paired speed-up over it (and the subject's over each rival)."""
    summary: dict[str, Any] = {}
    for raw in doc["cells"]:
        cell = Cell(**raw)
        if any(f"{cell.key}|{p}|{s}" not in doc["runs"] for p in doc["policies"]
               for s in doc["seeds"]):
            continue  # not fully run (an interrupted grid): no partial comparisons
        seeds = {p: _per_seed(doc, cell, p) for p in doc["policies"]}
        means = {p: statistics.fmean(v.values()) for p, v in seeds.items() if v}
        static = {p: m for p, m in means.items() if p in STATIC}
        if not static:
            continue
        best = min(static, key=lambda p: static[p])
        row: dict[str, Any] = {"mean_s": means, "best_static": best,
                               "infeasible": [p for p, v in seeds.items() if v is None]}
        crit = [b for s in doc["seeds"]
                for b in doc.get("bounds", {}).get(f"{cell.key}|{s}", [])[1:]]
        if crit:  # the most any schedule could gain over the best static layout
            row["critical_path_s"] = statistics.fmean(crit)
            row["headroom"] = static[best] / row["critical_path_s"]
        best_seeds = seeds[best]
        assert best_seeds is not None
        for p in doc["policies"]:
            v = seeds[p]
            if p in STATIC or v is None:
                continue
            g, lo, hi = paired_ratio(best_seeds, v)
            row[f"{p}_vs_best_static"] = [g, lo, hi]
            # what the first step costs (replay probes every degree there), and the whole
            # run with it counted
            for name, steps in (("step1", slice(0, 1)), ("all_steps", slice(None))):
                mine, best_k = _per_seed(doc, cell, p, steps), _per_seed(doc, cell, best, steps)
                if mine is not None and best_k is not None:
                    row[f"{p}_{name}_vs_best_static"] = list(paired_ratio(best_k, mine))
        subject = seeds.get(SUBJECT)
        if subject is not None:
            for p in RIVALS:
                v = seeds.get(p)
                if v is not None:
                    g, lo, hi = paired_ratio(v, subject)
                    row[f"{SUBJECT}_vs_{p}"] = [g, lo, hi]
        summary[cell.key] = row
    return summary


def verdicts(summary: dict[str, Any], floor: float = 0.98) -> dict[str, int]:
    """How many cells meet the bars: the paired ratio's centre (its geometric mean) at least
    ``floor`` of the best static layout, its whole interval not below 0.95, and issue 30's
    bars against the rivals."""
    n = meets_static = meets_rivals = not_behind = non_tp8 = non_tp8_115 = room_115 = 0
    above_095 = 0
    for row in summary.values():
        r = row.get(f"{SUBJECT}_vs_best_static")
        if r is None:
            continue
        n += 1
        meets_static += r[0] >= floor
        above_095 += r[2] >= 0.95
        # a rival that cannot run the cell (infeasible) is beaten
        rivals = [row[f"{SUBJECT}_vs_{p}"] for p in ("heddle", "libra")
                  if f"{SUBJECT}_vs_{p}" in row]
        meets_rivals += all(g >= 1.0 - 1e-9 for g, _, _ in rivals)
        not_behind += all(hi >= 1.0 for _, _, hi in rivals)  # the interval reaches 1
        if row["best_static"] != "verl-tp8":
            non_tp8 += 1
            non_tp8_115 += r[0] >= 1.15
            room_115 += row.get("headroom", 0.0) >= 1.15
    return {"cells": n, "at_least_0.98x_best_static": meets_static,
            "interval_not_below_0.95": above_095,
            "at_least_heddle_and_libra": meets_rivals,
            "not_significantly_behind_heddle_or_libra": not_behind,
            "best_static_not_tp8": non_tp8,
            "of_those_at_least_1.15x": non_tp8_115,
            "of_those_where_1.15x_is_possible": room_115}


def fmt_ratio(r: Sequence[float] | None) -> str:
    if r is None:
        return "-"
    g, lo, hi = r
    if math.isinf(lo) or math.isinf(hi):
        return f"{g:.2f}"
    return f"{g:.2f} ({lo:.2f}-{hi:.2f})"
