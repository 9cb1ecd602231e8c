"""A learned remaining-length predictor: a small MLP trained online on CPU.

In the spirit of Heddle's fine-tuned regressor (arXiv 2603.28101, section 4.1) but sized
for a gateway: features are the statistics the gateway already has (tokens so far, turn
count, own and group token rates, finished siblings, tool outcomes, the statistical
prediction itself), the target is log1p(remaining generated tokens). Each observation
of a live trajectory is kept with its features; when the trajectory finishes, its
samples get labels and join a bounded training buffer; the model takes a few Adam steps
every ``train_every`` finished trajectories. Until it has trained, it answers with the
statistical predictor it wraps.

torch is imported lazily here only (``pip install rollout-gateway[learned]``); the core
gateway never needs it.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping
from typing import Any

from gateway.policies.base import GroupView, Phase, Prediction, Snapshot, TrajectoryView
from gateway.policies.predict import DEFAULT_TAIL_RATIO, StatsPredictor, group_rate

N_FEATURES = 10


def features(traj: TrajectoryView, snap: Snapshot, stats: Prediction) -> list[float]:
    """Scale-free features (logs and fractions) so one model serves every workload."""
    g_rate, g_turns = group_rate(traj, snap)
    group = snap.groups.get(traj.group_id)
    fin = group.finished_lengths if group else ()
    fails = sum(o.endswith(":failure") for o in traj.outcomes)
    timeouts = sum(o.endswith(":timeout") for o in traj.outcomes)
    n_out = max(1, len(traj.outcomes))
    own_rate = traj.generated_tokens / traj.turns if traj.turns else 0.0
    return [
        math.log1p(traj.generated_tokens),
        math.log1p(traj.turns),
        math.log1p(own_rate),
        math.log1p(g_rate),
        math.log1p(g_turns),
        math.log1p(len(fin)),
        math.log1p(sum(fin) / len(fin)) if fin else 0.0,
        fails / n_out,
        timeouts / n_out,
        math.log1p(stats.mean),
    ]


class LearnedPredictor:
    """MLP (10 -> 32 -> 32 -> 1) on log remaining tokens, trained online."""

    name = "learned"

    def __init__(self, seed: int = 0, train_every: int = 8, min_finished: int = 16,
                 buffer: int = 20000, steps: int = 60) -> None:
        self.stats = StatsPredictor()
        self.train_every = train_every
        self.min_finished = min_finished
        self.steps = steps
        self._rng = random.Random(seed)
        self._seed = seed
        self._pending: dict[str, list[tuple[list[float], int]]] = {}
        self._buffer: deque[tuple[list[float], float]] = deque(maxlen=buffer)
        self._finished = 0
        self._model: Any = None
        self._torch: Any = None
        self._last: dict[str, tuple[list[float], int]] = {}

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        self.stats.observe(traj, groups, now)
        last = self._last.pop(traj.id, None)
        if last is not None:
            self._pending.setdefault(traj.id, []).append(last)
        if traj.phase is not Phase.FINISHED:
            return
        for f, gen in self._pending.pop(traj.id, []):
            self._buffer.append((f, math.log1p(max(0, traj.generated_tokens - gen))))
        self._finished += 1
        if self._finished >= self.min_finished and self._finished % self.train_every == 0:
            self._train()

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction:
        base = self.stats.predict(traj, snap)
        feats = features(traj, snap, base)
        self._last[traj.id] = (feats, traj.generated_tokens)  # labelled at the end
        if self._model is None:
            return base
        torch = self._torch
        with torch.no_grad():
            y = float(self._model(torch.tensor([feats], dtype=torch.float32))[0, 0])
        rem = math.expm1(max(0.0, min(y, 14.0)))
        return Prediction(rem, rem * DEFAULT_TAIL_RATIO)

    def _ensure_model(self) -> Any:
        if self._model is None:
            import torch  # lazy: optional extra

            torch.manual_seed(self._seed)
            torch.set_num_threads(1)
            self._torch = torch
            self._model = torch.nn.Sequential(
                torch.nn.Linear(N_FEATURES, 32), torch.nn.ReLU(),
                torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1),
            )
            self._opt = torch.optim.Adam(self._model.parameters(), lr=3e-3)
        return self._model

    def _train(self) -> None:
        model = self._ensure_model()
        torch = self._torch
        data = list(self._buffer)
        for _ in range(self.steps):
            batch = [data[self._rng.randrange(len(data))] for _ in range(min(256, len(data)))]
            x = torch.tensor([b[0] for b in batch], dtype=torch.float32)
            y = torch.tensor([[b[1]] for b in batch], dtype=torch.float32)
            loss = torch.nn.functional.smooth_l1_loss(model(x), y)
            self._opt.zero_grad()
            loss.backward()
            self._opt.step()
