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
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.reports.grid_summary import (
    RIVALS,
    STATIC,
    SUBJECT,
    Cell,
    fmt_ratio,
    summarize,
    verdicts,
)
from bench.simulator.metrics import critical_path
from bench.simulator.speeds import band_profiles, max_tp_for
from bench.simulator.steps import StepScenario, generate_step, run_steps
from bench.workloads import load_workloads

__all__ = ["RIVALS", "STATIC", "SUBJECT", "Cell", "Job", "cells", "critical_bound",
           "fmt_ratio", "run_grid", "run_job", "summarize", "verdicts"]


@dataclass(frozen=True, slots=True)
class Job:
    cell: Cell
    policy: str
    seed: int
    steps: int
    beliefs: str = "live"

    @property
    def key(self) -> str:
        return f"{self.cell.key}|{self.policy}|{self.seed}"


def run_job(job: Job) -> dict[str, Any]:
    """One policy, one seed, K steps: per-step makespans, or infeasible with the reason."""
    c = job.cell
    size = load_workloads()[c.workload]["group_size"]
    sc = StepScenario(c.workload, job.policy, seed=job.seed, steps=job.steps, gpus=c.gpus,
                      model=c.model, gpu=c.gpu, prompts=max(1, c.per_gpu * c.gpus // size),
                      tp_efficiency=c.band, beliefs=job.beliefs)
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
             progress: Callable[[int, int], None] | None = None,
             beliefs: str = "live") -> dict[str, Any]:
    """Run every (cell, policy, seed) not already in ``out`` (with ``resume``); the raw
    results are saved after each job under ``runs``. ``beliefs``: what policies are told
    of each TP's speed (:func:`bench.simulator.speeds.live_beliefs`)."""
    doc: dict[str, Any] = {"runs": {}}
    if resume and out.exists():
        doc = json.loads(out.read_text())
        if doc.get("beliefs", "true") != beliefs:
            raise ValueError(f"{out} was run with beliefs {doc.get('beliefs', 'true')!r}, "
                             f"not {beliefs!r}: resume it with those or write a new file")
    doc.update({"policies": list(policies), "seeds": list(seeds), "steps": steps,
                "beliefs": beliefs, "cells": [asdict(c) for c in todo]})
    pending = [Job(c, p, s, steps, beliefs) for c in todo for p in policies for s in seeds]
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
