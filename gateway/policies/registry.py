"""Named policies: ``get_policy(name)`` builds a fresh :class:`ComposedPolicy`.

Each name is a combination of mechanisms from ``placement``, ``resources`` and the
predictors; see ``docs/policies.md`` for the table. Only ``oracle`` may be given the
truth, through ``oracle_truth``, and it is labelled as an upper bound.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.policies.base import Policy
from gateway.policies.compose import ComposedPolicy
from gateway.policies.learned import LearnedPredictor
from gateway.policies.libra import LibraPlanner
from gateway.policies.ours import BlendPredictor
from gateway.policies.placement import (
    FCFS,
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
from gateway.policies.tree import CausalTree

#: Libra's example thresholds for Qwen3-14B (remaining tokens per bucket).
LIBRA_THRESHOLDS = {1: 4000, 2: 12000, 4: 30000}
LIBRA_INITIAL = {1: 0.5, 2: 0.25, 4: 0.25}
OURS_INITIAL = {4: 0.25}

POLICY_NAMES = ("slime", "verl", "verl-star", "round-robin", "las", "heddle",
                "heddle-learned", "libra", "ours", "oracle")


def _baseline(name: str, tp: int) -> ComposedPolicy:
    planner = UniformPlanner(tp)
    if name == "slime":
        return ComposedPolicy(name, FCFS(), LeastLoadedPlacer(), planner)
    if name == "verl":
        return ComposedPolicy(name, FCFS(), StickyPlacer(), planner)
    if name == "verl-star":
        return ComposedPolicy(name, FCFS(), StickyPlacer(rebalance=4), planner)
    if name == "round-robin":
        return ComposedPolicy(name, FCFS(), RoundRobinPlacer(), planner)
    return ComposedPolicy(name, LeastAttainedService(), LeastLoadedPlacer(), planner)


def _heddle(name: str, seed: int) -> ComposedPolicy:
    predictor = LearnedPredictor(seed) if name == "heddle-learned" else StatsPredictor()
    return ComposedPolicy(name, ProgressivePriority(), PresortedDPPlacer(),
                          TailMergePlanner(), predictor, GainMigrator())


def _libra() -> ComposedPolicy:
    placer = CMLFQPlacer(LIBRA_THRESHOLDS)
    return ComposedPolicy("libra", FCFS(), placer, LibraPlanner(placer, LIBRA_INITIAL),
                          CausalTree())


def get_policy(name: str, *, tp: int = 1, seed: int = 0,
               oracle_truth: Callable[[str, int], int] | None = None) -> Policy:
    """A fresh policy object by name; ``tp`` is the uniform TP of the baselines."""
    if name in ("slime", "verl", "verl-star", "round-robin", "las"):
        return _baseline(name, tp)
    if name in ("heddle", "heddle-learned"):
        return _heddle(name, seed)
    if name == "libra":
        return _libra()
    if name == "ours":
        return ComposedPolicy("ours", ProgressivePriority(), PresortedDPPlacer(),
                              JointPlanner(OURS_INITIAL), BlendPredictor(),
                              GainMigrator(locality=True))
    if name == "oracle":
        if oracle_truth is None:
            raise ValueError("the oracle policy needs oracle_truth (benchmark hints)")
        return ComposedPolicy("oracle", ProgressivePriority(), PresortedDPPlacer(),
                              JointPlanner(OURS_INITIAL), OraclePredictor(oracle_truth),
                              GainMigrator(locality=True),
                              label="oracle (upper bound)")
    raise ValueError(f"unknown policy {name!r}; available: {', '.join(POLICY_NAMES)}")
