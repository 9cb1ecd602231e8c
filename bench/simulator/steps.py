"""How RL runs: K steps over a resampled prompt pool, several seeds, intervals.

A step is one rollout batch: ``prompts`` prompts drawn from a pool of ``pool_factor x
prompts`` (without replacement within a step, independently across steps), each sampled
``group_size`` times. A prompt keeps its difficulty and prompt length across steps (it is
the same task), its samples are new every step, and trajectory ids are reused the way an
RL loop reuses them (``<prompt>-<sample>``), so a policy meets the same ids and prompt ids
again. One policy object serves all K steps of a run (predictor history, Libra's tree,
router trees carry over); each step starts from the policy's initial layout on a clock
that continues where the last step ended.

``run_seeds`` runs seeds in parallel processes and reports, per policy, the mean makespan
over steps 2..K (step 1 is cold) with a 95% Student-t interval across seeds.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from bench.simulator.des import SimConfig, Simulator
from bench.simulator.metrics import critical_path, gpu_work
from bench.simulator.speeds import band_profiles, live_beliefs, max_tp_for, speeds
from bench.simulator.weights import DEFAULT_UPDATE_S
from bench.workloads import TrajectorySpec, load_workloads, prompt_group
from gateway.policies.registry import ORACLE_NAMES, get_policy, resolve_name

#: two-sided 95% Student-t quantiles by degrees of freedom (df > 30: normal)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    if df <= 0:
        return math.inf
    best = max(k for k in T95 if k <= df) if df <= 30 else 0
    return T95[best] if best else 1.96


def interval(xs: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval); half-width inf for one sample."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.inf
    return m, t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def generate_step(name: str, seed: int, step: int, *, prompts: int | None = None,
                  group_size: int | None = None, pool_factor: int = 4,
                  max_context: int = 65536) -> list[TrajectorySpec]:
    """Step ``step`` (0-based) of a run: prompts drawn from the seed's pool."""
    table = load_workloads()
    if name not in table:
        raise ValueError(f"unknown workload {name!r}; available: {', '.join(sorted(table))}")
    w = table[name]
    n_prompts = prompts or w["prompts"]
    size = group_size or w["group_size"]
    picks = random.Random(f"{seed}:{name}:step{step}").sample(
        range(n_prompts * pool_factor), n_prompts)
    out: list[TrajectorySpec] = []
    for p in sorted(picks):
        out += prompt_group(
            name, w, p, size=size, max_context=max_context,
            task=random.Random(f"{seed}:{name}:{p}"),  # the prompt itself: same every step
            samples=random.Random(f"{seed}:{name}:{p}:{step}"))  # this step's samples
    return out


@dataclass(frozen=True, slots=True)
class StepScenario:
    workload: str
    policy: str
    seed: int = 1
    steps: int = 5
    gpus: int = 64
    model: str = "qwen3-14b"
    gpu: str = "H100"
    prompts: int | None = None
    group_size: int | None = None
    pool_factor: int = 4
    weight_update_every_s: float | None = None  # per step, from its start (weights.py)
    weight_update_mode: str = "wait"
    weight_update_s: float = DEFAULT_UPDATE_S
    tp_efficiency: str | float = "calibrated"  # a point of the band (docs/tp-efficiency.md)
    #: what policies believe of each TP's speed: ``live`` (the calibrated profile, corrected
    #: by what the engines measure, as a live gateway does) or ``true`` (the band's own)
    beliefs: str = "live"


@dataclass(slots=True)
class StepRun:
    scenario: StepScenario
    makespans: list[float] = field(default_factory=list)
    lb_critical: list[float] = field(default_factory=list)  # longest trajectory, best TP
    lb_work: list[float] = field(default_factory=list)  # total work / GPUs
    migrations: int = 0
    reconfigurations: int = 0
    weights: list[dict[str, float]] = field(default_factory=list)  # per step, when simulated


def run_steps(sc: StepScenario) -> StepRun:
    """One seed: K steps under one policy object."""
    profs = band_profiles(sc.model, sc.gpu, sc.tp_efficiency, max_tp_for(sc.gpus))
    cfg = SimConfig(sc.gpus, profs, speeds(profs), seed=sc.seed,
                    weight_update_every_s=sc.weight_update_every_s,
                    weight_update_mode=sc.weight_update_mode, weight_update_s=sc.weight_update_s)
    beliefs = live_beliefs(sc.model, sc.gpu, sc.gpus, sc.beliefs)
    truth: dict[str, int] = {}
    sees_truth = resolve_name(sc.policy) in ORACLE_NAMES
    oracle = (lambda tid, gen: truth[tid] - gen) if sees_truth else None
    policy = get_policy(sc.policy, seed=sc.seed, oracle_truth=oracle)
    run, t0 = StepRun(sc), 0.0
    for k in range(sc.steps):
        specs = generate_step(sc.workload, sc.seed, k, prompts=sc.prompts,
                              group_size=sc.group_size, pool_factor=sc.pool_factor)
        truth.clear()
        truth.update({s.id: s.total_output for s in specs})
        sim = Simulator(specs, policy, cfg, start_s=t0, beliefs=beliefs)
        end = sim.run()
        run.makespans.append(end - t0)
        run.lb_critical.append(max(min(critical_path(s, p) for p in profs.values())
                                   for s in specs))
        run.lb_work.append(sum(gpu_work(s, profs[1]) for s in specs) / sc.gpus)
        run.migrations += sim.stats.migrations
        run.reconfigurations += sim.stats.reconfigurations
        if sim.weights is not None:
            run.weights.append(sim.weights.summary())
        t0 = end + 1.0  # the trainer's step (not modelled) separates rollouts
    return run


def run_seeds(base: StepScenario, policies: Sequence[str], seeds: Sequence[int],
              jobs: int = 2) -> dict[str, list[StepRun]]:
    todo = [replace(base, policy=p, seed=s) for p in policies for s in seeds]
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        runs = list(ex.map(run_steps, todo))
    out: dict[str, list[StepRun]] = {p: [] for p in policies}
    for r in runs:
        out[r.scenario.policy].append(r)
    return out


def summarize(runs: dict[str, list[StepRun]], skip: int = 1) -> dict[str, dict[str, Any]]:
    """Per policy: mean makespan over steps ``skip+1..K`` per seed, then mean and 95% CI
    across seeds; the lower bound's two components likewise."""
    out: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        per_seed = [statistics.fmean(r.makespans[skip:] or r.makespans) for r in rs]
        crit = [statistics.fmean(r.lb_critical[skip:] or r.lb_critical) for r in rs]
        work = [statistics.fmean(r.lb_work[skip:] or r.lb_work) for r in rs]
        m, h = interval(per_seed)
        out[name] = {"mean_s": m, "ci95_s": h, "seeds": len(rs),
                     "per_seed_s": {str(r.scenario.seed): v for r, v in zip(rs, per_seed,
                                                                             strict=True)},
                     "lb_critical_s": statistics.fmean(crit), "lb_work_s": statistics.fmean(work),
                     "migrations": statistics.fmean(r.migrations for r in rs),
                     "reconfigurations": statistics.fmean(r.reconfigurations for r in rs)}
        if rs and rs[0].weights:  # per step, averaged over the reported steps and seeds
            out[name].update({f"w_{k}": statistics.fmean(
                w[k] for r in rs for w in (r.weights[skip:] or r.weights))
                for k in rs[0].weights[0]})
    return out


def paired_ratio(base: dict[str, float], other: dict[str, float]) -> tuple[float, float, float]:
    """``base / other`` makespan over the seeds both ran (the same batches per seed):
    (geometric mean, low, high) of the per-seed ratios with a 95% t-interval on their
    logarithms. Far tighter than comparing two across-seed intervals, because a seed's
    batch moves every policy's makespan together."""
    seeds = sorted(set(base) & set(other))
    if not seeds:
        raise ValueError("no seed in common")
    logs = [math.log(base[s] / other[s]) for s in seeds]
    m, h = interval(logs)
    return math.exp(m), math.exp(m - h), math.exp(m + h)
