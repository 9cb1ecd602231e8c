"""Online predictors of a trajectory's *remaining* generated tokens.

Every predictor learns only from what the gateway observes (``observe`` after each call
and at the end) and predicts from a :class:`TrajectoryView` plus the snapshot. The
oracle is the one exception, and it gets its knowledge through its constructor, so no
view type ever carries a hidden length.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Protocol

from gateway.policies.base import GroupView, Phase, Prediction, Snapshot, TrajectoryView

#: p90/mean ratio assumed before enough samples exist (lognormal with sigma ~0.6).
DEFAULT_TAIL_RATIO = 1.9


class Predictor(Protocol):
    name: str

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        ...

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction: ...


class TurnModel:
    """Empirical distribution of total turns and per-turn output over finished trajectories.

    ``remaining_turns(t)`` = E[T - t | T > t], the residual-life estimate; before enough
    data it assumes the Lindy-style ``max(2, t)`` (a process that lasted t turns is
    expected to last about as long again), the usual heavy-tail prior.
    """

    def __init__(self, min_samples: int = 8) -> None:
        self.min_samples = min_samples
        self._turns: list[int] = []  # sorted
        self._suffix: list[int] = []  # suffix sums of _turns, rebuilt lazily
        self._dirty = False
        self.tokens_total = 0
        self.turns_total = 0

    def add(self, turns: int, generated: int) -> None:
        bisect.insort(self._turns, turns)
        self._dirty = True
        self.tokens_total += generated
        self.turns_total += turns

    @property
    def count(self) -> int:
        return len(self._turns)

    def rate(self, default: float) -> float:
        return self.tokens_total / self.turns_total if self.turns_total else default

    def remaining_turns(self, t: int) -> float:
        n = len(self._turns)
        if n < self.min_samples:
            return float(max(2, t))
        if self._dirty:
            acc = 0
            self._suffix = [0] * (n + 1)
            for i in range(n - 1, -1, -1):
                acc += self._turns[i]
                self._suffix[i] = acc
            self._dirty = False
        i = bisect.bisect_right(self._turns, t)
        alive = n - i
        if alive == 0:
            return 1.0  # longer than everything seen: expect it to end soon-ish, >0
        return max(1.0, self._suffix[i] / alive - t)


def group_rate(traj: TrajectoryView, snap: Snapshot) -> tuple[float, int]:
    """Mean output tokens per turn of the live siblings (and their total turns).

    Siblings share a prompt, and a prompt's difficulty scales every member's output, so
    the group's pooled rate is a far less noisy estimate of this member's rate than its
    own few turns (GRPO group statistics, Heddle section 4).
    """
    group = snap.groups.get(traj.group_id)
    if group is None:
        return 0.0, 0
    tokens = turns = 0
    for tid in group.members:
        sib = snap.trajectories.get(tid)
        if sib is not None and sib.turns:
            tokens += sib.generated_tokens
            turns += sib.turns
    tokens += sum(group.finished_lengths)
    turns += sum(group.finished_turns)
    return (tokens / turns if turns else 0.0), turns


class StatsPredictor:
    """Heddle's practical start: statistics a gateway can compute live.

    remaining = rate x E[remaining turns | turns so far], where rate shrinks this
    trajectory's own tokens-per-turn toward its group's pooled rate (and the global
    rate), and, once siblings finished, is blended with the siblings' mean total minus
    what this one already generated. Same prompt across batches counts like a sibling.
    """

    name = "stats"

    def __init__(self, shrink_turns: float = 4.0) -> None:
        self.shrink_turns = shrink_turns
        self.turn_model = TurnModel()
        self.prompt_totals: dict[str, list[int]] = defaultdict(list)

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        if traj.phase is Phase.FINISHED:
            self.turn_model.add(traj.turns, traj.generated_tokens)
            self.prompt_totals[traj.prompt_id].append(traj.generated_tokens)

    def rate(self, traj: TrajectoryView, snap: Snapshot) -> float:
        prior = self.turn_model.rate(default=500.0)
        g_rate, g_turns = group_rate(traj, snap)
        own_turns = traj.turns
        own = traj.generated_tokens / own_turns if own_turns else 0.0
        k = self.shrink_turns
        g_w = min(g_turns - own_turns, 4 * k) if g_turns > own_turns else 0
        g_mean = (g_rate * g_turns - traj.generated_tokens) / max(1, g_turns - own_turns)
        return (own * own_turns + g_mean * g_w + prior * k / 2) / (own_turns + g_w + k / 2)

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction:
        rem = self.rate(traj, snap) * self.turn_model.remaining_turns(traj.turns)
        group = snap.groups.get(traj.group_id)
        totals = list(group.finished_lengths) if group else []
        totals += self.prompt_totals.get(traj.prompt_id, [])
        if totals:
            sib = sum(totals) / len(totals) - traj.generated_tokens
            w = len(totals) / (len(totals) + 2.0)
            rem = (1 - w) * rem + w * max(sib, 0.15 * rem)
        return Prediction(rem, rem * DEFAULT_TAIL_RATIO)


class OraclePredictor:
    """Knows the true remaining tokens (from workload hints): an upper bound only.

    ``truth(trajectory_id, generated_so_far)`` is supplied by the benchmark driver; it is
    the only door through which hidden lengths reach a policy.
    """

    name = "oracle"

    def __init__(self, truth: Callable[[str, int], int]) -> None:
        self.truth = truth

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        return None

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction:
        rem = float(self.truth(traj.id, traj.generated_tokens))
        return Prediction(rem, rem)


def log_blend(parts: list[tuple[float, float]]) -> float:
    """Weighted geometric mean of positive estimates (robust to one being off by 10x)."""
    total_w = sum(w for _, w in parts)
    if total_w <= 0:
        return 0.0
    return math.exp(sum(w * math.log1p(max(0.0, v)) for v, w in parts) / total_w) - 1.0
