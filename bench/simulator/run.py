"""Run one policy over one generated batch in the simulator and summarize it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.simulator.des import SimConfig, Simulator
from bench.simulator.metrics import Result, lower_bound, summarize
from bench.simulator.speeds import band_profiles, max_tp_for, profiles, speeds
from bench.simulator.weights import DEFAULT_UPDATE_S
from bench.workloads import TrajectorySpec, generate
from gateway.policies.registry import ORACLE_NAMES, get_policy, resolve_name


@dataclass(frozen=True, slots=True)
class Scenario:
    workload: str
    model: str = "qwen3-14b"
    gpu: str = "H100"
    gpus: int = 64
    seed: int = 1
    tp: int = 1  # uniform TP of the baselines
    prompts: int | None = None  # shrink the batch (smoke tests); None = the workload's
    group_size: int | None = None
    cap_per_gpu: int | None = None  # None: engine admission (max_num_seqs per instance)
    tp_penalty: float | None = None  # wins over tp_efficiency when set (calibration sweeps)
    weight_update_every_s: float | None = None  # bench/simulator/weights.py; None = off
    weight_update_mode: str = "wait"
    weight_update_s: float = DEFAULT_UPDATE_S
    tp_efficiency: str | float = "calibrated"  # a point of the band (docs/tp-efficiency.md)


class Bench:
    """One batch, its lower bound, and one run per policy (same batch every time)."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.specs: list[TrajectorySpec] = generate(
            sc.workload, sc.seed, prompts=sc.prompts, group_size=sc.group_size)
        max_tp = max_tp_for(sc.gpus)
        self.profiles = (band_profiles(sc.model, sc.gpu, sc.tp_efficiency, max_tp)
                         if sc.tp_penalty is None
                         else profiles(sc.model, sc.gpu, sc.tp_penalty, max_tp))
        self.speeds = speeds(self.profiles)
        self.lower_bound = lower_bound(self.specs, self.profiles, sc.gpus)
        totals = {s.id: s.total_output for s in self.specs}
        self._truth: Callable[[str, int], int] = lambda tid, gen: totals[tid] - gen

    def run(self, name: str, progress: Callable[[int], None] | None = None) -> Result:
        sc = self.sc
        # the only door to hidden lengths
        truth = self._truth if resolve_name(name) in ORACLE_NAMES else None
        policy = get_policy(name, tp=sc.tp, seed=sc.seed, oracle_truth=truth)
        cfg = SimConfig(sc.gpus, self.profiles, self.speeds, cap_per_gpu=sc.cap_per_gpu,
                        seed=sc.seed, weight_update_every_s=sc.weight_update_every_s,
                        weight_update_mode=sc.weight_update_mode,
                        weight_update_s=sc.weight_update_s)
        started = time.perf_counter()
        sim = Simulator(self.specs, policy, cfg, progress)
        makespan = sim.run()
        return summarize(sim, makespan, self.lower_bound, time.perf_counter() - started)
