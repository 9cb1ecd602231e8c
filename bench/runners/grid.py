"""``bench grid``: policies against every uniform static layout across the cost model's
uncertainty (issue 30's grid).

A cell is (model, GPU, GPUs, trajectories per GPU, workload, TP-efficiency point); in each,
every policy runs the same K-step batches per seed (``bench.simulator.steps``), and the
cell reports each policy's mean makespan over steps 2..K and its paired ratio against the
best uniform static layout of that cell (verl's routing at TP 1, 2, 4 and 8, the fastest
by mean). A layout that cannot run the workload (a call needs more KV cache than one
instance has: qwen3-32b at TP1) is recorded as infeasible, not as a crash.

Runs are independent jobs in a process pool; results are written to the JSON file after
every finished job, so an interrupted grid keeps what it ran and ``--resume`` skips it.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.simulator.metrics import critical_path
from bench.simulator.speeds import band_profiles, max_tp_for
from bench.simulator.steps import StepScenario, generate_step, paired_ratio, run_steps
from bench.workloads import load_workloads

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


@dataclass(frozen=True, slots=True)
class Job:
    cell: Cell
    policy: str
    seed: int
    steps: int

    @property
    def key(self) -> str:
        return f"{self.cell.key}|{self.policy}|{self.seed}"


def run_job(job: Job) -> dict[str, Any]:
    """One policy, one seed, K steps: per-step makespans, or infeasible with the reason."""
    c = job.cell
    size = load_workloads()[c.workload]["group_size"]
    sc = StepScenario(c.workload, job.policy, seed=job.seed, steps=job.steps, gpus=c.gpus,
                      model=c.model, gpu=c.gpu, prompts=max(1, c.per_gpu * c.gpus // size),
                      tp_efficiency=c.band)
    try:
        run = run_steps(sc)
    except ValueError as exc:  # the engine refused a call: this layout cannot serve it
        return {"infeasible": str(exc)}
    return {"makespans": run.makespans, "reconfigurations": run.reconfigurations}


def critical_bound(cell: Cell, seed: int, steps: int) -> list[float]:
    """Per step, the longest trajectory alone at its best TP: no schedule of the step ends
    sooner, so best static / this is the most any policy could gain over it."""
    size = load_workloads()[cell.workload]["group_size"]
    profs = band_profiles(cell.model, cell.gpu, cell.band, max_tp_for(cell.gpus))
    return [max(min(critical_path(s, p) for p in profs.values()) for s in generate_step(
        cell.workload, seed, k, prompts=max(1, cell.per_gpu * cell.gpus // size)))
        for k in range(steps)]


def cells(models: Sequence[str], gpu_kinds: Sequence[str], pools: Sequence[int],
          loads: Sequence[int], workloads: Sequence[str], bands: Sequence[str]) -> list[Cell]:
    return [Cell(*p) for p in itertools.product(models, gpu_kinds, pools, loads, workloads,
                                                bands)]


def run_grid(todo: Sequence[Cell], policies: Sequence[str], seeds: Sequence[int], steps: int,
             out: Path, jobs: int = 2, resume: bool = False,
             progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Run every (cell, policy, seed) not already in ``out`` (with ``resume``); the raw
    results are saved after each job under ``runs``."""
    doc: dict[str, Any] = {"runs": {}}
    if resume and out.exists():
        doc = json.loads(out.read_text())
    doc.update({"policies": list(policies), "seeds": list(seeds), "steps": steps,
                "cells": [asdict(c) for c in todo]})
    pending = [Job(c, p, s, steps) for c in todo for p in policies for s in seeds]
    pending = [j for j in pending if j.key not in doc["runs"]]
    done, total = 0, len(pending)
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = {ex.submit(run_job, j): j for j in pending}
        for f in as_completed(futs):
            doc["runs"][futs[f].key] = f.result()
            done += 1
            out.write_text(json.dumps(doc, indent=1))
            if progress is not None:
                progress(done, total)
    bounds = doc.setdefault("bounds", {})
    for c in todo:
        for s in seeds:
            if f"{c.key}|{s}" not in bounds:
                bounds[f"{c.key}|{s}"] = critical_bound(c, s, steps)
    doc["summary"] = summarize(doc)
    out.write_text(json.dumps(doc, indent=1))
    return doc


def _per_seed(doc: dict[str, Any], cell: Cell, policy: str) -> dict[str, float] | None:
    out: dict[str, float] = {}
    for s in doc["seeds"]:
        r = doc["runs"].get(f"{cell.key}|{policy}|{s}")
        if r is None or "infeasible" in r:
            return None
        ms = r["makespans"][1:] or r["makespans"]  # step 1 is cold
        out[str(s)] = statistics.fmean(ms)
    return out


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Per cell: mean makespan per policy, the best static layout, and each non-static
    policy's paired speed-up over it (and the subject's over each rival)."""
    summary: dict[str, Any] = {}
    for raw in doc["cells"]:
        cell = Cell(**raw)
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
    """How many cells meet issue 30's bars (point estimates of the paired ratios)."""
    n = meets_static = meets_rivals = non_tp8 = non_tp8_115 = room_115 = 0
    for row in summary.values():
        r = row.get(f"{SUBJECT}_vs_best_static")
        if r is None:
            continue
        n += 1
        meets_static += r[0] >= floor
        rivals = [row[f"{SUBJECT}_vs_{p}"][0] for p in ("heddle", "libra")
                  if f"{SUBJECT}_vs_{p}" in row]
        meets_rivals += bool(rivals) and min(rivals) >= 1.0 - 1e-9
        if row["best_static"] != "verl-tp8":
            non_tp8 += 1
            non_tp8_115 += r[0] >= 1.15
            room_115 += row.get("headroom", 0.0) >= 1.15
    return {"cells": n, "at_least_0.98x_best_static": meets_static,
            "at_least_heddle_and_libra": meets_rivals, "best_static_not_tp8": non_tp8,
            "of_those_at_least_1.15x": non_tp8_115,
            "of_those_where_1.15x_is_possible": room_115}


def fmt_ratio(r: Sequence[float] | None) -> str:
    if r is None:
        return "-"
    g, lo, hi = r
    if math.isinf(lo) or math.isinf(hi):
        return f"{g:.2f}"
    return f"{g:.2f} ({lo:.2f}-{hi:.2f})"
