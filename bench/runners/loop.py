"""``bench loop``'s runs: step modes against the best static synchronous layout.

One *cell* (workload, model, GPU, pool, TP-efficiency point) is run in three phases:

1. ``sync`` on every uniform static layout, with ``screen_seeds`` seeds: the best static
   layout is the one with the shortest mean rollout per step (for ``sync`` the samples per
   hour follow exactly from the rollout times, the train time and the push, since the pool
   idles while the trainer works: :meth:`LoopRun.samples_per_hour`). The best layout then
   runs the remaining seeds.
2. The trainer's time per step is ``train_ratio`` x that layout's mean rollout per step
   (rollout is 70-90% of an agentic RL step in the systems DESIGN.md cites: ratios 0.1-0.4).
3. Every other step mode on the best static layout (and on any ``policies`` asked for,
   such as ``replay``), all seeds, each trainer ratio.
4. ``colocated`` sync, if asked (:class:`Colocated`): the same job's GPUs, the pool's and
   the trainer's, all rolling out and then all training, in turn (verl's default).

Every mode is compared with the best static layout's ``sync`` at the same trainer time,
per seed (the same groups in the same order), as paired ratios of trained output tokens
per hour (the headline: what the trainer learns from) and of samples per hour (which
rewards a mode that trains short samples first: its length bias is beside it).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.simulator.loop import run_loop
from bench.simulator.loop_run import LoopRun, LoopScenario
from bench.simulator.speeds import band_profiles, max_tp_for
from bench.simulator.steps import interval, paired_ratio
from bench.workloads import load_workloads

STATIC = ("verl-tp1", "verl-tp2", "verl-tp4", "verl-tp8")
#: the step modes a cell runs besides ``sync``: name -> LoopScenario fields
MODE_RUNS: dict[str, dict[str, Any]] = {
    "overprovisioned": {"mode": "overprovisioned", "carry": True},
    "overprovisioned-drop": {"mode": "overprovisioned", "carry": False},
    "async": {"mode": "async"},
    "tail-batching": {"mode": "tail-batching"},
}
SHARES = ("lag0_share", "lag1_share", "lag2_share", "lag3plus_share", "max_staleness",
          "idle_share", "wasted_share", "length_bias", "restarts", "dropped_groups",
          "sandboxes_mean", "sandboxes_peak")
PEAKS = ("max_staleness", "sandboxes_peak")


@dataclass(frozen=True, slots=True)
class Colocated:
    """A colocated synchronous job against the disaggregated one (verl's default,
    ``actor_rollout_ref`` on one set of GPUs): the pool's GPUs and the trainer's
    ``trainer_gpus`` all roll out (engines at ``memory`` of each GPU: the trainer's state
    keeps part of it; verl's default 0.5, slime's advice 0.7-0.8), then all train (the
    trainer's step shrinks by ``trainer_gpus / (pool + trainer_gpus)``: linear scaling,
    the most it could gain), then switch (``switch_s`` per step: the rollout engines
    sleep, the trainer's state comes back and goes again, the weights move in place; it
    replaces the disaggregated push). Its per-hour figures compare with the disaggregated
    rows on the same job GPUs, pool plus trainer. With ``batch`` k it runs k times the
    groups per step and its trainer takes k times as long, as ``sync x{k}``."""

    trainer_gpus: int
    memory: float
    switch_s: float
    batch: int = 1  # groups per step, times the disaggregated sync's (as ``sync x{k}``)

    @property
    def name(self) -> str:
        times = f" x{self.batch}" if self.batch > 1 else ""
        return (f"colocated sync{times} +{self.trainer_gpus} GPUs, memory {self.memory:g}, "
                f"switch {self.switch_s:g} s")

    @property
    def job(self) -> tuple[int, float, int]:
        """What its rollouts depend on (the switch does not change them)."""
        return self.trainer_gpus, self.memory, self.batch


def _fits(base: LoopScenario, layouts: Sequence[str], memory: float) -> list[str]:
    """The uniform layouts whose degree leaves KV cache at ``memory``."""
    have = band_profiles(base.model, base.gpu, base.tp_efficiency, max_tp_for(base.gpus),
                         memory)
    return [lay for lay in layouts if int(lay.rsplit("tp", 1)[1]) in have]


def _run_all(todo: list[LoopScenario], jobs: int,
             progress: Callable[[int], None]) -> list[LoopRun]:
    if jobs <= 1:
        out = []
        for sc in todo:
            out.append(run_loop(sc))
            progress(1)
        return out
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        runs = []
        for r in ex.map(run_loop, todo):
            runs.append(r)
            progress(1)
        return runs


def _rollout(run: LoopRun) -> float:
    return statistics.fmean(run.rollout_s[1:] or run.rollout_s)


def best_sync(base: LoopScenario, layouts: Sequence[str], seeds: Sequence[int],
              screen_seeds: int, jobs: int,
              progress: Callable[[int], None]) -> tuple[str, dict[str, list[LoopRun]]]:
    """Phase 1: every layout's ``sync`` on the first ``screen_seeds`` seeds, then the
    fastest on the rest."""
    screen = list(seeds[:screen_seeds])
    todo = [replace(base, policy=lay, mode="sync", seed=s, train_s=0.0)
            for lay in layouts for s in screen]
    runs: dict[str, list[LoopRun]] = {lay: [] for lay in layouts}
    for r in _run_all(todo, jobs, progress):
        runs[r.scenario.policy].append(r)
    best = min(layouts, key=lambda lay: statistics.fmean(_rollout(r) for r in runs[lay]))
    rest = [replace(base, policy=best, mode="sync", seed=s, train_s=0.0)
            for s in seeds[screen_seeds:]]
    runs[best] += _run_all(rest, jobs, progress)
    return best, runs


def _per_seed(runs: list[LoopRun], train_s: float, tokens: bool) -> dict[str, float]:
    """Samples (or trained output tokens) per hour, by seed; a sync run's at ``train_s``."""
    return {str(r.scenario.seed): (r.tokens_per_hour if tokens else r.samples_per_hour)(
        train_s if r.scenario.mode == "sync" else None) for r in runs}


def _entry(runs: list[LoopRun], base: list[LoopRun], train_s: float,
           own_train_s: float | None = None) -> dict[str, Any]:
    """``runs`` against the best static sync ``base`` at trainer time ``train_s``
    (``runs`` at ``own_train_s`` if given: a sync run with a larger batch trains longer)."""
    own = train_s if own_train_s is None else own_train_s
    sph, tph = _per_seed(runs, own, False), _per_seed(runs, own, True)
    sums = [r.summary(own if r.scenario.mode == "sync" else None) for r in runs]
    mean, half = interval(list(sph.values()))
    out: dict[str, Any] = {"samples_per_hour": mean, "ci95": half, "per_seed": sph,
                           "seeds": len(runs)}
    # this / best static sync, per seed (the same groups in the same order)
    g, lo, hi = paired_ratio(sph, _per_seed(base, train_s, False))
    out["vs_best_sync"] = {"geomean": g, "ci95_low": lo, "ci95_high": hi}
    mean, half = interval(list(tph.values()))
    out |= {"tokens_per_hour": mean, "tokens_ci95": half, "tokens_per_seed": tph}
    g, lo, hi = paired_ratio(tph, _per_seed(base, train_s, True))
    out["tokens_vs_best_sync"] = {"geomean": g, "ci95_low": lo, "ci95_high": hi}
    for k in SHARES:
        out[k] = (max if k in PEAKS else statistics.fmean)(s[k] for s in sums)
    return out


def run_cell(base: LoopScenario, *, layouts: Sequence[str], modes: Sequence[str],
             policies: Sequence[str], seeds: Sequence[int], screen_seeds: int,
             train_ratios: Sequence[float], jobs: int, sync_batches: Sequence[int] = (),
             colocated: Sequence[Colocated] = (),
             progress: Callable[[int], None] = lambda _: None) -> dict[str, Any]:
    """One cell: the best static sync layout, then every mode at every trainer ratio.

    ``sync_batches``: also ``sync`` on the best layout with k times the groups per step
    (``sync x{k}``), its trainer taking k times as long (the trainer's time grows with
    the batch): the baseline a sync user gets by raising the batch until the pool is
    busy, which an asynchronous mode's concurrency has to beat.

    ``colocated``: also a colocated sync job per entry (:class:`Colocated`), on its own
    best uniform layout (every degree that fits swept, as the disaggregated one), the
    same groups per step or ``batch`` times as many; runs differing only in ``switch_s``
    share their rollouts (a sync step's time is rollout + train + switch exactly)."""
    best, sync_runs = best_sync(base, layouts, seeds, screen_seeds, jobs, progress)
    rollout = statistics.fmean(_rollout(r) for r in sync_runs[best])
    cell: dict[str, Any] = {
        "scenario": asdict(base), "best_static": best, "rollout_s": rollout,
        "sync_rollout_s": {lay: statistics.fmean(_rollout(r) for r in rs)
                           for lay, rs in sync_runs.items()},
        "ratios": {}}
    subjects = [best, *[p for p in policies if p != best]]
    other_sync = _run_all([replace(base, policy=p, mode="sync", seed=s, train_s=0.0)
                           for p in subjects[1:] for s in seeds], jobs, progress)
    prompts = base.prompts or load_workloads()[base.workload]["prompts"]
    bigger = {k: _run_all([replace(base, policy=best, mode="sync", seed=s, train_s=0.0,
                                   prompts=prompts * k) for s in seeds], jobs, progress)
              for k in sync_batches}
    colo: dict[tuple[int, float, int], tuple[str, list[LoopRun]]] = {}
    for k, mem, times in dict.fromkeys(c.job for c in colocated):
        job = replace(base, gpus=base.gpus + k, memory=mem, prompts=prompts * times)
        c_best, c_runs = best_sync(job, _fits(job, layouts, mem), seeds, screen_seeds, jobs,
                                   progress)
        colo[(k, mem, times)] = c_best, c_runs[c_best]
        label = f"{f'x{times} ' if times > 1 else ''}+{k} GPUs, memory {mem:g}"
        cell.setdefault("colocated_rollout_s", {})[label] = {
            lay: statistics.fmean(_rollout(r) for r in rs) for lay, rs in c_runs.items()}
    for ratio in train_ratios:
        t = ratio * rollout
        best_runs = sync_runs[best]
        todo = [replace(base, policy=who, seed=s, train_s=t, **MODE_RUNS[m])
                for m in modes for who in subjects for s in seeds]
        done = _run_all(todo, jobs, progress)
        rows: dict[str, Any] = {f"sync@{best}": _entry(best_runs, best_runs, t)}
        for j, p in enumerate(subjects[1:]):
            rows[f"sync@{p}"] = _entry(other_sync[j * len(seeds):][:len(seeds)], best_runs, t)
        for k, runs in bigger.items():
            rows[f"sync x{k}@{best}"] = _entry(runs, best_runs, t, own_train_s=k * t)
        for k, m in enumerate(modes):
            for j, who in enumerate(subjects):
                part = done[(k * len(subjects) + j) * len(seeds):][:len(seeds)]
                rows[f"{m}@{who}"] = _entry(part, best_runs, t)
        for c in colocated:
            c_best, runs = colo[c.job]
            runs = [_switched(r, c.switch_s) for r in runs]
            share = c.trainer_gpus / (base.gpus + c.trainer_gpus)
            rows[f"{c.name}@{c_best}"] = _entry(runs, best_runs, t,
                                                own_train_s=t * c.batch * share)
        cell["ratios"][str(ratio)] = {"train_s": t, "rows": rows}
    return cell


def _switched(run: LoopRun, switch_s: float) -> LoopRun:
    """``run`` (a sync run) with each step's push replaced by ``switch_s``: exact, as the
    push happens with the pool idle and every trajectory of the round done."""
    return replace(run, scenario=replace(run.scenario, push_s=switch_s))


def cell_count(layouts: int, modes: int, policies: int, seeds: int, screen: int,
               ratios: int, batches: int = 0, colocated: int = 0) -> int:
    """Runs one cell takes (for a progress bar; ``colocated``: distinct colocated jobs
    (:attr:`Colocated.job`), each swept over at most ``layouts``)."""
    sweep = layouts * screen + (seeds - screen)
    return sweep * (1 + colocated) + (policies + batches) * seeds + ratios * (
        modes * (1 + policies) * seeds)
