"""Results of one simulated batch: makespan, throughput, latency tails, lower bound,
predictor accuracy.

Lower bound (DESIGN.md): max of (a) the longest critical path of any trajectory served
alone at its best TP, tool and setup time included, and (b) the batch's total GPU work
over the pool, where work is counted at its most efficient (every decode token at the
marginal cost of a large TP1 batch: weight streaming amortized away).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from backends.sim.profiles import LatencyProfile
from bench.simulator.des import Simulator
from bench.workloads import TrajectorySpec


@dataclass(slots=True)
class Result:
    policy: str
    label: str
    makespan_s: float
    throughput_tok_s: float
    p50_trajectory_s: float
    p99_trajectory_s: float
    lower_bound_makespan_s: float
    migrations: int
    reconfigurations: int
    preemptions: int
    prefix_cache_hit_rate: float
    rank_corr: float | None
    tail_recall: float | None
    wall_s: float
    weights: dict[str, float] | None = None  # weight updates, when simulated (weights.py)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def critical_path(spec: TrajectorySpec, p: LatencyProfile) -> float:
    """Seconds for ``spec`` alone on an instance of profile ``p`` (cache always hit)."""
    t = spec.setup_s
    ctx = 0
    prompt = spec.prompt_tokens
    for turn in spec.turns:
        new = prompt - ctx
        t += p.step_ms(num_tokens=new, prefill_attn=new * (ctx + new / 2)) / 1000.0
        k = turn.output_tokens - 1
        if k > 0:  # decode steps, context growing by one each step
            base = p.step_ms(num_tokens=1, decode_ctx_tokens=prompt)
            t += (k * base + p.A_ms_per_1k_ctx / 1000.0 * k * (k - 1) / 2) / 1000.0
        ctx = prompt + turn.output_tokens
        prompt = ctx + turn.obs_tokens
        t += turn.tool_s
    return t


def gpu_work(spec: TrajectorySpec, p: LatencyProfile) -> float:
    """GPU-seconds of ``spec`` on TP1 at the marginal per-token cost (no W, no T0)."""
    k = p.K_ms_per_tok
    ms = 0.0
    ctx = 0
    prompt = spec.prompt_tokens
    for turn in spec.turns:
        new = prompt - ctx
        ms += k * new + p.Q_ms_per_1e6 * new * (ctx + new / 2) / 1e6
        n = turn.output_tokens
        ms += n * k + p.A_ms_per_1k_ctx * (n * prompt + n * n / 2) / 1000.0
        ctx = prompt + n
        prompt = ctx + turn.obs_tokens
    return ms / 1000.0


def lower_bound(specs: list[TrajectorySpec], profiles: dict[int, LatencyProfile],
                gpus: int) -> float:
    longest = max(min(critical_path(s, p) for p in profiles.values()) for s in specs)
    work = sum(gpu_work(s, profiles[1]) for s in specs) / gpus
    return max(longest, work)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else None


def _ranks(v: list[float]) -> list[float]:
    order = sorted(range(len(v)), key=v.__getitem__)
    ranks = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def tail_recall(predicted: dict[str, float], truth: dict[str, int], frac: float = 0.1) -> float:
    """Of the true top ``frac`` longest, the fraction also in the predicted top ``frac``."""
    ids = [t for t in truth if t in predicted]
    k = max(1, int(len(ids) * frac))
    top_true = set(sorted(ids, key=lambda t: -truth[t])[:k])
    top_pred = set(sorted(ids, key=lambda t: -predicted[t])[:k])
    return len(top_true & top_pred) / k


def summarize(sim: Simulator, makespan: float, lb: float, wall_s: float) -> Result:
    specs = [t.spec for t in sim.trajs.values()]
    durations = sorted((t.finished_at or 0.0) - t.started_at for t in sim.trajs.values())
    tokens = sum(s.total_output for s in specs)
    preds = sim.stats.predictions
    corr = spearman([p for p, _ in preds], [float(t) for _, t in preds]) if preds else None
    recall = (tail_recall(sim.stats.early, {s.id: s.total_output for s in specs})
              if sim.stats.early else None)
    q = sum(i.engine.kv.queries for i in sim.instances.values())
    h = sum(i.engine.kv.hits for i in sim.instances.values())
    pol = sim.policy
    return Result(
        pol.name, pol.label or pol.name, makespan, tokens / makespan,
        durations[len(durations) // 2], durations[min(len(durations) - 1,
                                                      int(0.99 * len(durations)))],
        lb, sim.stats.migrations, sim.stats.reconfigurations, sim.stats.preemptions,
        h / q if q else 0.0, corr, recall, wall_s,
        sim.weights.summary() if sim.weights is not None else None)
