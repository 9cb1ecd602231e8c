"""Queue order (prioritizers) and where calls go (placers).

Sources: FCFS / least-loaded (contrast baseline), cache-aware (slime: the SGLang router
it starts, ``sgl-router`` ``cache_aware`` policy), sticky (verl), sticky with
rebalance (verl*, as described by Heddle section 2), least-attained-service (Autellix,
arXiv 2502.13965), progressive priority and presorted-DP placement (Heddle, arXiv
2603.28101, sections 4-5), C-MLFQ buckets (Libra, arXiv 2606.03077, section 4).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping

from gateway.policies.base import PendingCall, Prediction, Slots, Snapshot, TrajectoryView
from gateway.policies.compose import least_loaded
from gateway.policies.dp import presorted_dp

# ------------------------------------------------------------------ prioritizers


class FCFS:
    """Arrival order in the gateway queue."""

    def key(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
            now: float) -> float:
        return call.enqueued_at


class LeastAttainedService:
    """Autellix: least LLM service received so far runs first (minimizes mean latency,
    the opposite of LPT; a contrast baseline). Key in milliseconds of attained service."""

    def key(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
            now: float) -> float:
        return traj.llm_time_s * 1000.0


class ProgressivePriority:
    """Heddle's progressive priority: longest predicted *remaining* first (online LPT).

    Aging: every second waited in the queue counts as ``aging_tokens_per_s`` predicted
    tokens, so a short call's key falls linearly while it waits and it overtakes any
    finite prediction: wait is bounded by (max prediction gap) / aging rate.
    """

    def __init__(self, aging_tokens_per_s: float = 400.0) -> None:
        self.aging = aging_tokens_per_s

    def key(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
            now: float) -> float:
        remaining = pred.mean if pred is not None else 0.0
        return -remaining - self.aging * max(0.0, now - call.enqueued_at)


# ------------------------------------------------------------------ placers


class _Base:
    def refresh(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> None:
        return None

    def target_of(self, trajectory_id: str) -> str | None:
        return None


class LeastLoadedPlacer(_Base):
    """slime: every call to the instance with the most free slots, blind to history."""

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        return least_loaded(slots, snap)


class CacheAwarePlacer(_Base):
    """slime's routing: the SGLang router's ``cache_aware`` policy (sgl-router defaults).

    The router keeps an approximate prefix tree per worker of the requests it sent there.
    If the pool is imbalanced (max - min running > ``balance_abs`` *and* max > min *
    ``balance_rel``) the call goes to the least-loaded worker. Otherwise it goes to the
    worker with the longest prefix match if ``matched / prompt > cache_threshold``, else
    to the worker whose tree is smallest (most cache room). The tree is modelled from what
    the gateway sees: a trajectory's earlier prompts (its context) and its group's shared
    first prompt, per worker; no engine state is read.
    """

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._traj: dict[str, dict[str, int]] = {}  # worker -> trajectory -> tokens sent
        self._group: dict[str, set[str]] = {}  # worker -> prompt ids sent there
        self._prompt_len: dict[str, int] = {}  # prompt id -> first prompt's tokens
        self._size: dict[str, int] = {}  # worker -> tokens in its tree

    def _match(self, iid: str, call: PendingCall, traj: TrajectoryView) -> int:
        own = self._traj.get(iid, {}).get(traj.id, 0)
        shared = (self._prompt_len.get(traj.prompt_id, 0)
                  if traj.prompt_id in self._group.get(iid, ()) else 0)
        return min(call.context_tokens, max(own, shared))

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        up = [i for i in snap.instances if i.up]
        if not up:
            return None
        loads = [i.running for i in up]
        hi, lo = max(loads), min(loads)
        target: str | None
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            target = least_loaded(slots, snap)
        else:
            best = max(up, key=lambda i: (self._match(i.id, call, traj), i.id))
            rate = self._match(best.id, call, traj) / max(1, call.context_tokens)
            if rate > self.cache_threshold:
                target = best.id
            else:
                target = min(up, key=lambda i: (self._size.get(i.id, 0), i.running,
                                                i.id)).id
            if target not in slots.free:
                target = least_loaded(slots, snap)
        if target is not None:
            self._insert(target, call, traj)
        return target

    def _insert(self, iid: str, call: PendingCall, traj: TrajectoryView) -> None:
        self._prompt_len.setdefault(traj.prompt_id, call.context_tokens)
        sent = self._traj.setdefault(iid, {})
        before = sent.get(traj.id, 0)
        grew = max(0, call.context_tokens - max(before, self._match(iid, call, traj)))
        sent[traj.id] = max(before, call.context_tokens)
        self._group.setdefault(iid, set()).add(traj.prompt_id)
        self._size[iid] = self._size.get(iid, 0) + grew


class RoundRobinPlacer(_Base):
    """Next instance (by id order) that has a free slot."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        ids = sorted(slots.free)
        return ids[next(self._counter) % len(ids)] if ids else None


class StickyPlacer(_Base):
    """verl: a trajectory stays where its first call went (prefix cache reuse); new
    trajectories are dealt round robin. On a pool of mixed TP degrees (replay's probe
    layout, a lane switched off) they are dealt in proportion to each instance's GPUs
    instead (the fewest dealt per GPU first), so a TP1 instance beside TP8 ones is not
    handed as many trajectories as each of them.

    With ``rebalance`` (verl*), it leaves its instance when that one is full and the
    max/min load gap exceeds the threshold; otherwise it waits for its instance.
    """

    def __init__(self, rebalance: int | None = None) -> None:
        self.rebalance = rebalance
        self._counter = itertools.count()
        self._dealt: Counter[str] = Counter()  # mixed pools: new trajectories per instance

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        home = snap.instance(traj.instance)
        if home is None or not home.up:
            # a new trajectory (or one whose instance left): round robin, as verl's
            # async rollout manager assigns new requests to servers
            ids = sorted(slots.free)
            if not ids:
                return None
            if len({i.tp for i in snap.instances if i.up}) > 1:
                tp = {i.id: i.tp for i in snap.instances}
                pick = min(ids, key=lambda i: ((self._dealt[i] + 1) / tp.get(i, 1), i))
                self._dealt[pick] += 1
                return pick
            return ids[next(self._counter) % len(ids)]
        if home.id in slots.free:
            return home.id
        if self.rebalance is None:
            return None
        loads = [i.running for i in snap.instances if i.up]
        if max(loads) - min(loads) > self.rebalance:
            return least_loaded(slots, snap)
        return None


class PresortedDPPlacer(_Base):
    """Heddle's presorted dynamic-programming placement (section 5).

    ``refresh`` sorts live trajectories by predicted remaining length and splits them
    into contiguous groups, fastest instance first, minimizing the predicted makespan
    ``max_j T_j * F_j(n_j) * L_j`` (see :func:`presorted_dp`). ``choose`` keeps a
    trajectory where its prefix cache is (moves happen through migration in tool gaps),
    sends new ones to their DP target, and falls back to least-loaded after ``hold_s``.
    """

    def __init__(self, hold_s: float = 2.0) -> None:
        self.hold_s = hold_s
        self._target: dict[str, str] = {}

    def refresh(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> None:
        self._target = presorted_dp(snap, preds)

    def target_of(self, trajectory_id: str) -> str | None:
        return self._target.get(trajectory_id)

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        for want in (traj.instance, self._target.get(traj.id)):
            if want is not None and want in slots.free:
                return want
        home = snap.instance(traj.instance) or snap.instance(self._target.get(traj.id))
        if home is not None and home.up and snap.now - call.enqueued_at < self.hold_s:
            return None
        return least_loaded(slots, snap)


class CMLFQPlacer(_Base):
    """Libra's C-MLFQ: buckets of instances by TP, each with a token threshold.

    New trajectories start in the smallest bucket. When a fresh prediction is available
    (after each tool return), the buckets of its mean and of its P90 are computed; the
    trajectory moves only when both agree and differ from its current bucket (moves may
    skip levels, up or down). Within a bucket: least-loaded. A full bucket falls back to
    the other buckets (nearest first), then to the least-loaded instance anywhere.
    """

    def __init__(self, thresholds: Mapping[int, int]) -> None:
        self.levels = sorted(thresholds.items())  # (tp, max remaining tokens)
        self.bucket: dict[str, int] = {}
        self._seen_turn: dict[str, int] = {}

    def bucket_of(self, tokens: float) -> int:
        for idx, (_, limit) in enumerate(self.levels):
            if tokens <= limit:
                return idx
        return len(self.levels) - 1

    def _update(self, traj: TrajectoryView, pred: Prediction | None) -> int:
        cur = self.bucket.setdefault(traj.id, 0)
        if pred is None or self._seen_turn.get(traj.id) == traj.turns:
            return cur
        self._seen_turn[traj.id] = traj.turns
        b_mean, b_p90 = self.bucket_of(pred.mean), self.bucket_of(pred.p90)
        if b_mean == b_p90 != cur:
            self.bucket[traj.id] = cur = b_mean
        return cur

    def target_tp(self, traj: TrajectoryView) -> int:
        return self.levels[self.bucket.get(traj.id, 0)][0]

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        level = self._update(traj, pred)
        present = {i.tp for i in snap.instances if i.up}
        # nearest level that has instances (the planner may have emptied one)
        order = sorted(range(len(self.levels)), key=lambda b: (abs(b - level), -b))
        for b in order:
            tp = self.levels[b][0]
            if tp in present:
                ids = {i.id for i in snap.instances if i.tp == tp and i.up}
                if traj.instance in ids and traj.instance in slots.free:
                    return traj.instance
                got = least_loaded(slots, snap, ids)
                if got is not None:
                    return got
        # every bucket full: the least-loaded instance anywhere (Libra's router fallback)
        return least_loaded(slots, snap)
