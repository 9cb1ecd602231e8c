"""Libra's causal prefix tree of tool outcomes (arXiv 2606.03077, section 4.2).

A path is the prompt id followed by the tool states seen so far (``bash:small:failure``
...). Each node keeps the remaining generated tokens observed *after* that prefix in
recent finished trajectories (a bounded window, so the estimate follows drift), and
reports their mean and P90. Unseen prompts fall back to a global tree keyed by the state
sequence alone. Lookup takes the deepest prefix with enough samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from gateway.policies.base import GroupView, Phase, Prediction, Snapshot, TrajectoryView
from gateway.policies.predict import DEFAULT_TAIL_RATIO, TurnModel

Path = tuple[str, ...]


class _Node:
    __slots__ = ("samples",)

    def __init__(self, window: int) -> None:
        self.samples: deque[int] = deque(maxlen=window)

    def stats(self) -> Prediction:
        s = sorted(self.samples)
        mean = sum(s) / len(s)
        return Prediction(mean, float(s[min(len(s) - 1, int(0.9 * len(s)))]))


class CausalTree:
    """Prompt-keyed and global prefix trees over tool-state sequences."""

    name = "causal-tree"

    def __init__(self, window: int = 64, min_samples: int = 3, max_depth: int = 24) -> None:
        self.window = window
        self.min_samples = min_samples
        self.max_depth = max_depth
        self._nodes: dict[Path, _Node] = {}
        # generated tokens after each observed prefix depth, per live trajectory
        self._progress: dict[str, list[int]] = {}
        self.turn_model = TurnModel()

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        marks = self._progress.setdefault(traj.id, [0])
        depth = min(len(traj.outcomes), self.max_depth)
        while len(marks) <= depth:
            marks.append(traj.generated_tokens)
        if traj.phase is Phase.FINISHED:
            self._learn(traj, self._progress.pop(traj.id))
            self.turn_model.add(traj.turns, traj.generated_tokens)

    def _learn(self, traj: TrajectoryView, marks: list[int]) -> None:
        total = traj.generated_tokens
        for d, gen in enumerate(marks):
            states = traj.outcomes[:d]
            for path in ((traj.prompt_id, *states), ("*", *states)):
                node = self._nodes.get(path)
                if node is None:
                    node = self._nodes[path] = _Node(self.window)
                node.samples.append(total - gen)

    def lookup(self, traj: TrajectoryView) -> tuple[Prediction, int] | None:
        """(mean, P90) at the deepest prefix with enough samples, and that depth+1.

        The prompt tree wins over the global tree at equal depth (it is more specific).
        """
        states = traj.outcomes[: self.max_depth]
        marks = self._progress.get(traj.id, [])
        for d in range(len(states), -1, -1):
            for root in (traj.prompt_id, "*"):
                node = self._nodes.get((root, *states[:d]))
                if node is not None and len(node.samples) >= self.min_samples:
                    # a shallower match predates some of this trajectory's progress:
                    # take off what it generated since (floored; it is still running)
                    done = traj.generated_tokens - marks[d] if d < len(marks) else 0
                    st = node.stats()
                    keep = max(0.25, 1.0 - done / st.mean) if st.mean > 0 else 1.0
                    return Prediction(st.mean * keep, st.p90 * keep), d + 1
        return None

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction:
        found = self.lookup(traj)
        if found is not None:
            return found[0]
        rem = self.turn_model.rate(500.0) * self.turn_model.remaining_turns(traj.turns)
        return Prediction(rem, rem * DEFAULT_TAIL_RATIO)
