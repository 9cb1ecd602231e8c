"""How long a step's longest trajectories take with the rest of the batch removed.

The lower bound ``bench steps`` reports (each trajectory alone at its best TP) ignores that
the long trajectories of a step overlap: tens of them decode at once, and every engine
step is slowed by the others' KV reads. This estimate keeps that and drops everything
else. For each RL step of a run it keeps only the ``k`` trajectories with the longest
critical path at TP8, runs them through the simulator under each given layout, and takes
the fastest. A schedule of the whole batch also has to run those ``k``, alongside the
rest, so its makespan is at least about this figure; the estimate for a step is the
largest over ``k``.

It is an estimate, not a proof: only the given layouts are tried for the subset (by
default the static TP8 and TP4 pools with verl's routing, the best layouts for the whole
batch; a policy with a perfect predictor may be given, since this is a benchmark), and
each subset starts from a fresh policy. ``docs/policies.md`` and
BENCHMARKS.md say how it is used.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

from bench.simulator.des import SimConfig, Simulator
from bench.simulator.metrics import critical_path
from bench.simulator.speeds import band_profiles, max_tp_for, speeds
from bench.simulator.steps import StepScenario, generate_step
from bench.workloads import TrajectorySpec
from gateway.policies.registry import ORACLE_NAMES, get_policy, resolve_name

#: the layouts tried for each subset unless told otherwise
DEFAULT_LAYOUTS = ("verl-tp8", "verl-tp4")


def longest(specs: Iterable[TrajectorySpec], k: int, tp: int = 8, *,
            model: str = "qwen3-14b", gpu: str = "H100",
            tp_efficiency: str | float = "calibrated") -> list[TrajectorySpec]:
    """The ``k`` trajectories with the longest critical path alone at ``tp``."""
    prof = band_profiles(model, gpu, tp_efficiency, tp)[tp]
    return sorted(specs, key=lambda s: (-critical_path(s, prof), s.id))[:k]


@dataclass(frozen=True, slots=True)
class TailJob:
    scenario: StepScenario  # workload, gpus, model, batch shape, seed; policy = the layout
    step: int  # 0-based
    k: int


def tail_makespan(job: TailJob) -> float:
    """Seconds for the step's ``k`` longest trajectories alone under ``job``'s layout."""
    sc = job.scenario
    max_tp = max_tp_for(sc.gpus)
    profs = band_profiles(sc.model, sc.gpu, sc.tp_efficiency, max_tp)
    cfg = SimConfig(sc.gpus, profs, speeds(profs), seed=sc.seed)
    specs = generate_step(sc.workload, sc.seed, job.step, prompts=sc.prompts,
                          group_size=sc.group_size, pool_factor=sc.pool_factor)
    subset = longest(specs, job.k, max_tp, model=sc.model, gpu=sc.gpu,
                     tp_efficiency=sc.tp_efficiency)
    truth = {s.id: s.total_output for s in subset}
    sees_truth = resolve_name(sc.policy) in ORACLE_NAMES
    oracle = (lambda tid, gen: truth[tid] - gen) if sees_truth else None
    policy = get_policy(sc.policy, seed=sc.seed, oracle_truth=oracle)
    return Simulator(subset, policy, cfg).run()


@dataclass(slots=True)
class TailResult:
    """Per seed: each (k, layout)'s makespan averaged over the reported steps, and the
    estimate (per step the largest over k of the fastest layout, then averaged)."""
    ks: list[int]
    layouts: list[str]
    per_seed: dict[str, dict[tuple[int, str], float]]
    estimate: dict[str, float]

    def mean(self, k: int, layout: str) -> float:
        return statistics.fmean(v[(k, layout)] for v in self.per_seed.values())


def run_tail(base: StepScenario, ks: Sequence[int], layouts: Sequence[str],
             seeds: Sequence[int], jobs: int = 2, skip: int = 1,
             progress: Callable[[int, int], None] | None = None) -> TailResult:
    """Every (seed, step ``skip+1..K``, k, layout) in ``jobs`` processes."""
    if base.steps <= skip:
        raise ValueError(f"steps must exceed the {skip} skipped step(s)")
    todo = [TailJob(replace(base, policy=p, seed=s), st, k)
            for s in seeds for st in range(skip, base.steps) for k in ks for p in layouts]
    got: dict[TailJob, float] = {}
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = {ex.submit(tail_makespan, j): j for j in todo}
        for f in as_completed(futs):
            got[futs[f]] = f.result()
            if progress is not None:
                progress(len(got), len(todo))
    steps = range(skip, base.steps)
    per_seed: dict[str, dict[tuple[int, str], float]] = {}
    estimate: dict[str, float] = {}
    for s in seeds:
        def at(st: int, k: int, p: str, s: int = s) -> float:
            return got[TailJob(replace(base, policy=p, seed=s), st, k)]
        per_seed[str(s)] = {(k, p): statistics.fmean(at(st, k, p) for st in steps)
                            for k in ks for p in layouts}
        estimate[str(s)] = statistics.fmean(max(min(at(st, k, p) for p in layouts) for k in ks)
                                            for st in steps)
    return TailResult(list(ks), list(layouts), per_seed, estimate)
