"""Named policies: ``get_policy(name)`` builds a fresh :class:`ComposedPolicy`.

Each name is a combination of mechanisms from ``placement``, ``resources`` and the
predictors; see ``docs/policies.md`` for the table. Only the names in ``ORACLE_NAMES``
(ours, or ours with the straggler lane, given a perfect length predictor) may be given the
truth, through ``oracle_truth``; they are *not* upper bounds (they know nothing about tool
time and still schedule online): they say what a mechanism could do with perfect
predictions.

Static layouts: a baseline name with a ``-tpN`` suffix (``slime-tp4``, ``verl-tp8``) runs
that routing on a uniform TP-N pool, whatever ``tp`` says.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.policies.base import Policy
from gateway.policies.compose import ComposedPolicy
from gateway.policies.lane import LaneMigrator, LanePlacer, LanePlanner, LanePriority
from gateway.policies.learned import LearnedPredictor
from gateway.policies.libra import LIBRA_CONFIGS, LibraPlanner, LibraTree
from gateway.policies.ours import BlendPredictor
from gateway.policies.placement import (
    FCFS,
    CacheAwarePlacer,
    CMLFQPlacer,
    LeastAttainedService,
    LeastLoadedPlacer,
    PresortedDPPlacer,
    ProgressivePriority,
    RoundRobinPlacer,
    StickyPlacer,
)
from gateway.policies.predict import OraclePredictor, StatsPredictor
from gateway.policies.resources import GainMigrator, JointPlanner, TailMergePlanner, UniformPlanner

OURS_INITIAL = {4: 0.25}
#: trajectories kept on the straggler lane (``ours-lane``)
LANE_K = 8

POLICY_NAMES = ("slime", "verl", "verl-star", "round-robin", "las", "heddle",
                "heddle-learned", "libra", "libra-search", "ours", "ours-lane", "ours-perfect",
                "ours-lane-perfect")
#: the only names that see hidden lengths (benchmarks only; a live gateway has none)
ORACLE_NAMES = ("ours-perfect", "ours-lane-perfect")
#: what a live gateway can run: every name but those that need hidden lengths
LIVE_NAMES = tuple(n for n in POLICY_NAMES if n not in ORACLE_NAMES)
BASELINES = ("slime", "verl", "verl-star", "round-robin", "las")
STATIC_TPS = (1, 2, 4, 8)
#: Every static-layout name (``slime-tp1`` ... ``verl-tp8``) ``get_policy`` accepts.
STATIC_NAMES = tuple(f"{b}-tp{t}" for b in BASELINES for t in STATIC_TPS)
ALL_NAMES = POLICY_NAMES + STATIC_NAMES


def _baseline(name: str, tp: int, label: str | None = None) -> ComposedPolicy:
    planner = UniformPlanner(tp)
    if name == "slime":
        return ComposedPolicy(label or name, FCFS(), CacheAwarePlacer(), planner)
    if name == "verl":
        return ComposedPolicy(label or name, FCFS(), StickyPlacer(), planner)
    if name == "verl-star":
        return ComposedPolicy(label or name, FCFS(), StickyPlacer(rebalance=4), planner)
    if name == "round-robin":
        return ComposedPolicy(label or name, FCFS(), RoundRobinPlacer(), planner)
    return ComposedPolicy(label or name, LeastAttainedService(), LeastLoadedPlacer(), planner)


def _heddle(name: str, seed: int) -> ComposedPolicy:
    predictor = LearnedPredictor(seed) if name == "heddle-learned" else StatsPredictor()
    return ComposedPolicy(name, ProgressivePriority(), PresortedDPPlacer(),
                          TailMergePlanner(), predictor, GainMigrator())


def _libra(name: str) -> ComposedPolicy:
    """``libra``: its R2E-Gym Qwen3-14B config; ``libra-search``: its Search-R1 one."""
    cfg = LIBRA_CONFIGS["search" if name == "libra-search" else "r2e"]
    placer = CMLFQPlacer(cfg.thresholds)
    return ComposedPolicy(name, FCFS(), placer, LibraPlanner(placer, cfg.initial),
                          LibraTree(), label=f"libra ({cfg.name} config)")


def get_policy(name: str, *, tp: int = 1, seed: int = 0,
               oracle_truth: Callable[[str, int], int] | None = None) -> Policy:
    """A fresh policy object by name; ``tp`` is the uniform TP of the baselines."""
    if name in BASELINES:
        return _baseline(name, tp)
    base, _, suffix = name.rpartition("-tp")
    if base in BASELINES and suffix.isdigit() and int(suffix) in STATIC_TPS:
        return _baseline(base, int(suffix), name)
    if name in ("heddle", "heddle-learned"):
        return _heddle(name, seed)
    if name in ("libra", "libra-search"):
        return _libra(name)
    if name == "ours":
        return ComposedPolicy("ours", ProgressivePriority(), PresortedDPPlacer(),
                              JointPlanner(OURS_INITIAL), BlendPredictor(),
                              GainMigrator(locality=True))
    if name in ("ours-lane", "ours-lane-perfect"):
        lane = LanePlanner(LANE_K)
        placer = LanePlacer(LANE_K, lane)
        if name == "ours-lane":
            return ComposedPolicy(name, LanePriority(lane), placer, lane, BlendPredictor(),
                                  LaneMigrator(placer), label="ours + straggler lane")
        if oracle_truth is None:
            raise ValueError(f"{name} needs oracle_truth (the benchmark's hidden lengths)")
        return ComposedPolicy(name, LanePriority(lane), placer, lane,
                              OraclePredictor(oracle_truth), LaneMigrator(placer),
                              label="ours + straggler lane + perfect predictor")
    if name == "ours-perfect":
        if oracle_truth is None:
            raise ValueError("ours-perfect needs oracle_truth (the benchmark's hidden lengths)")
        return ComposedPolicy("ours-perfect", ProgressivePriority(), PresortedDPPlacer(),
                              JointPlanner(OURS_INITIAL), OraclePredictor(oracle_truth),
                              GainMigrator(locality=True),
                              label="ours + perfect predictor")
    raise ValueError(f"unknown policy {name!r}; available: {', '.join(POLICY_NAMES)}")
