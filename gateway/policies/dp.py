"""Heddle's presorted dynamic program for trajectory placement (arXiv 2603.28101, sec. 5).

Sort trajectories by predicted remaining length, longest first; split the sorted list
into contiguous groups, one per instance, fastest instance first::

    D(i, j) = min_k max(D(k, j-1), T_j * F_j(i-k) * L(k+1))

``T_j`` is instance j's per-token time at low load, ``F_j(n) = 1 + slope*(n-1)`` its
interference factor, ``L(k+1)`` the longest member of the group (the first, since the
list is sorted). As in the paper, short trajectories are aggregated into chunks so the
program stays small (here at most ``max_units`` units; numpy over k and i makes each
instance column one vectorized step: a few milliseconds for 64 instances).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gateway.policies.base import Prediction, Snapshot, TPSpeed


def units_of(lengths_desc: Sequence[float], max_units: int = 48,
             singles: int = 24) -> list[tuple[int, int, float]]:
    """(start index, count, longest) units: the top ``singles`` alone, the rest chunked."""
    n = len(lengths_desc)
    if n <= max_units:
        return [(i, 1, lengths_desc[i]) for i in range(n)]
    out = [(i, 1, lengths_desc[i]) for i in range(singles)]
    rest = n - singles
    chunk = -(-rest // (max_units - singles))
    for start in range(singles, n, chunk):
        out.append((start, min(chunk, n - start), lengths_desc[start]))
    return out


def dp_split(units: Sequence[tuple[int, int, float]],
             speeds: Sequence[TPSpeed]) -> tuple[float, list[tuple[int, int]]]:
    """Optimal contiguous split of ``units`` over instances ``speeds`` (fastest first).

    Returns the predicted makespan (seconds of token time) and, per instance, the
    half-open unit range it gets (possibly empty).
    """
    n, m = len(units), len(speeds)
    if n == 0 or m == 0:
        return 0.0, [(0, 0)] * m
    counts = np.zeros(n + 1)
    counts[1:] = np.cumsum([u[1] for u in units])
    longest = np.array([u[2] for u in units] + [0.0])
    k_idx = np.arange(n + 1)[:, None]
    i_idx = np.arange(n + 1)[None, :]
    valid = k_idx < i_idx
    size = counts[None, :] - counts[:, None]  # size[k, i] = members of group k..i-1
    d = np.full(n + 1, np.inf)
    d[0] = 0.0
    choices = []
    for sp in speeds:
        cost = sp.per_token_s * (1.0 + sp.slope * np.maximum(size - 1, 0)) * longest[:, None]
        cand = np.where(valid, np.maximum(d[:, None], cost), np.inf)
        best_k = np.argmin(cand, axis=0)
        best = cand[best_k, np.arange(n + 1)]
        use = best < d  # else the instance stays empty
        choices.append(np.where(use, best_k, -1))
        d = np.where(use, best, d)
    ranges: list[tuple[int, int]] = []
    i = n
    for choice in reversed(choices):
        k = int(choice[i])
        if k < 0:
            ranges.append((i, i))
        else:
            ranges.append((k, i))
            i = k
    ranges.reverse()
    return float(d[n]), ranges


def presorted_dp(snap: Snapshot, preds: Mapping[str, Prediction]) -> dict[str, str]:
    """Target instance per live trajectory (those with a prediction)."""
    insts = [i for i in snap.instances if i.up and i.tp in snap.speeds]
    if not insts or not preds:
        return {}
    insts.sort(key=lambda i: (snap.speeds[i.tp].per_token_s, i.id))
    order = sorted(preds, key=lambda t: (-preds[t].mean, t))
    units = units_of([preds[t].mean for t in order])
    _, ranges = dp_split(units, [snap.speeds[i.tp] for i in insts])
    target: dict[str, str] = {}
    for inst, (a, b) in zip(insts, ranges, strict=True):
        for start, count, _ in units[a:b]:
            for t in order[start:start + count]:
                target[t] = inst.id
    return target


def layout_makespan(lengths_desc: Sequence[float], layout: Sequence[int],
                    speeds: Mapping[int, TPSpeed]) -> float:
    """Predicted token-time makespan of serving ``lengths_desc`` on TP ``layout``."""
    sp = sorted((speeds[tp] for tp in layout), key=lambda s: s.per_token_s)
    return dp_split(units_of(lengths_desc), sp)[0]
