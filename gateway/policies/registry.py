"""Named policies: ``get_policy(name)`` builds a fresh :class:`ComposedPolicy`.

Each name is a combination of mechanisms from ``placement``, ``resources`` and the
predictors; see ``docs/policies.md`` for the table. Only the names in ``ORACLE_NAMES``
(``progressive`` and ``straggler-lane`` given a perfect length predictor) may be given the
truth, through ``oracle_truth``; they are *not* upper bounds (they know nothing about tool
time and still schedule online): they say what a mechanism could do with perfect
predictions.

Static layouts: a baseline name with a ``-tpN`` suffix (``slime-tp4``, ``verl-tp8``) runs
that routing on a uniform TP-N pool, whatever ``tp`` says.

Names say the mechanism: ``progressive`` (progressive priority, presorted-DP placement,
joint TP planning, gain migration), ``straggler-lane`` (a lane for the predicted
stragglers, verl routing and context balancing for the rest), ``replay`` (the lane on a
layout whose TP is chosen each step by replaying the last step's observed workload with the
measured speeds), ``-oracle`` for a perfect length predictor. The names these had before
(``ours``, ``ours-lane``, ``ours-perfect``, ``ours-lane-perfect``) are still accepted for a
while: :func:`resolve_name` maps them to the new ones and logs a deprecation warning once
per name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from gateway.policies.base import Policy
from gateway.policies.blend import BlendPredictor
from gateway.policies.compose import ComposedPolicy
from gateway.policies.lane import LaneMigrator, LanePlacer, LanePlanner, LanePriority
from gateway.policies.learned import LearnedPredictor
from gateway.policies.libra import LIBRA_CONFIGS, LibraPlanner, LibraTree
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
from gateway.policies.replay import ReplayPlanner
from gateway.policies.resources import GainMigrator, JointPlanner, TailMergePlanner, UniformPlanner

log = logging.getLogger(__name__)

#: share of the GPUs ``progressive`` starts at TP4
PROGRESSIVE_INITIAL = {4: 0.25}
#: trajectories kept on the straggler lane (``straggler-lane``)
LANE_K = 8

POLICY_NAMES = ("slime", "verl", "verl-star", "round-robin", "las", "heddle",
                "heddle-learned", "libra", "libra-search", "progressive", "straggler-lane",
                "replay", "progressive-oracle", "straggler-lane-oracle")
#: the only names that see hidden lengths (benchmarks only; a live gateway has none)
ORACLE_NAMES = ("progressive-oracle", "straggler-lane-oracle")
#: names before issue 29, accepted during the alias period (admin API, config, CLI)
DEPRECATED_NAMES = {"ours": "progressive", "ours-lane": "straggler-lane",
                    "ours-perfect": "progressive-oracle",
                    "ours-lane-perfect": "straggler-lane-oracle"}
_WARNED: set[str] = set()
#: what a live gateway can run: every name but those that need hidden lengths
LIVE_NAMES = tuple(n for n in POLICY_NAMES if n not in ORACLE_NAMES)
BASELINES = ("slime", "verl", "verl-star", "round-robin", "las")
STATIC_TPS = (1, 2, 4, 8)
#: Every static-layout name (``slime-tp1`` ... ``verl-tp8``) ``get_policy`` accepts.
STATIC_NAMES = tuple(f"{b}-tp{t}" for b in BASELINES for t in STATIC_TPS)
ALL_NAMES = POLICY_NAMES + STATIC_NAMES


def resolve_name(name: str, *, warned: set[str] = _WARNED) -> str:
    """The current name for ``name``: an old name maps to its new one, with a deprecation
    warning logged the first time each old name is seen (``warned`` remembers them)."""
    new = DEPRECATED_NAMES.get(name)
    if new is None:
        return name
    if name not in warned:
        warned.add(name)
        log.warning("policy name %r is deprecated; use %r (the old name will be removed)",
                    name, new)
    return new


def resolve_names(names: Iterable[str]) -> list[str]:
    """:func:`resolve_name` for each name, order kept."""
    return [resolve_name(n) for n in names]


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


def _oracle(name: str, truth: Callable[[str, int], int] | None) -> OraclePredictor:
    if truth is None:
        raise ValueError(f"{name} needs oracle_truth (the benchmark's hidden lengths)")
    return OraclePredictor(truth)


def _progressive(name: str, truth: Callable[[str, int], int] | None) -> ComposedPolicy:
    oracle = name.endswith("-oracle")
    return ComposedPolicy(name, ProgressivePriority(), PresortedDPPlacer(),
                          JointPlanner(PROGRESSIVE_INITIAL),
                          _oracle(name, truth) if oracle else BlendPredictor(),
                          GainMigrator(locality=True),
                          label="progressive + perfect predictor" if oracle else "")


def _straggler_lane(name: str, truth: Callable[[str, int], int] | None) -> ComposedPolicy:
    oracle = name.endswith("-oracle")
    lane = LanePlanner(LANE_K)
    placer = LanePlacer(LANE_K, lane)
    predictor = _oracle(name, truth) if oracle else BlendPredictor()
    return ComposedPolicy(name, LanePriority(lane), placer, lane, predictor,
                          LaneMigrator(placer),
                          label=f"straggler lane{' + perfect predictor' if oracle else ''}")


def _replay(name: str) -> ComposedPolicy:
    planner = ReplayPlanner(LANE_K)
    placer = LanePlacer(LANE_K, planner)
    return ComposedPolicy(name, LanePriority(planner), placer, planner, BlendPredictor(),
                          LaneMigrator(placer), label="straggler lane on the replayed layout")


def get_policy(name: str, *, tp: int = 1, seed: int = 0,
               oracle_truth: Callable[[str, int], int] | None = None) -> Policy:
    """A fresh policy object by name (old names accepted); ``tp`` is the uniform TP of
    the baselines."""
    name = resolve_name(name)
    if name in BASELINES:
        return _baseline(name, tp)
    base, _, suffix = name.rpartition("-tp")
    if base in BASELINES and suffix.isdigit() and int(suffix) in STATIC_TPS:
        return _baseline(base, int(suffix), name)
    if name in ("heddle", "heddle-learned"):
        return _heddle(name, seed)
    if name in ("libra", "libra-search"):
        return _libra(name)
    if name in ("progressive", "progressive-oracle"):
        return _progressive(name, oracle_truth)
    if name in ("straggler-lane", "straggler-lane-oracle"):
        return _straggler_lane(name, oracle_truth)
    if name == "replay":
        return _replay(name)
    raise ValueError(f"unknown policy {name!r}; available: {', '.join(POLICY_NAMES)}")
