"""The predictor of ``progressive`` and ``straggler-lane``.

One predictor blending group statistics, the causal tree and live progress.

Sources and rationale:

- Group statistics and live progress (Heddle sec. 4's practical predictor): the pooled
  tokens-per-turn of GRPO siblings estimates the prompt's difficulty after one turn;
  residual-life turn estimates use how far the trajectory already got.
- Libra's causal tree (sec. 4.2): tool-outcome prefixes (timeouts, failures) carry
  information the rate does not; its P90 gives the tail width.
- The blend is a weighted geometric mean: both inputs are multiplicative estimates and a
  log blend keeps one wild estimate from dominating; the tree's weight grows with the
  depth of the prefix it matched (more specific history, more trust), but stays small:
  in a cold batch the tree's samples come from the trajectories that finished first,
  a survivorship bias (its rank correlation on its own: ``docs/benchmarks/history.md``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.policies.base import GroupView, Prediction, Snapshot, TrajectoryView
from gateway.policies.predict import DEFAULT_TAIL_RATIO, StatsPredictor, log_blend
from gateway.policies.tree import CausalTree


class BlendPredictor:
    name = "blend"

    def __init__(self) -> None:
        self.stats = StatsPredictor()
        self.tree = CausalTree()

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        self.stats.observe(traj, groups, now)
        self.tree.observe(traj, groups, now)

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction:
        s = self.stats.predict(traj, snap)
        found = self.tree.lookup(traj)
        if found is None:
            return s
        t, depth = found
        w_tree = 0.05 * min(depth, 4)
        mean = log_blend([(s.mean, 1.0), (t.mean, w_tree)])
        tail = t.p90 / t.mean if t.mean > 0 else DEFAULT_TAIL_RATIO
        return Prediction(mean, mean * max(1.0, tail))
