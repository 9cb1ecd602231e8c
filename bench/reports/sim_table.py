"""Tables for benchmark results (rich)."""

from __future__ import annotations

from rich.table import Table

from bench.simulator.metrics import Result
from bench.simulator.run import Scenario


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(sc: Scenario, results: list[Result], lower_bound: float) -> Table:
    base = next((r for r in results if r.policy == "slime"), results[0])
    t = Table(title=f"bench sim: {sc.workload}, {sc.model} on {sc.gpus}x{sc.gpu}, seed "
                    f"{sc.seed} (lower bound {lower_bound:.0f} s){_schedule(sc)}")
    for col in ("policy", "makespan s", "x LB", "tok/s", "x slime", "p50 s", "p99 s",
                "migr", "reconf", "cache hit", "rank corr", "tail recall", "wall s"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    weights = any(r.weights is not None for r in results)
    if weights:
        for col in ("updates", "paused s", "stale mean", "stale max", "stale tok",
                    "span calls"):
            t.add_column(col, justify="right")
    for r in results:
        extra = _weights_cells(r) if weights else []
        t.add_row(r.label, f"{r.makespan_s:.0f}", f"{r.makespan_s / lower_bound:.2f}",
                  f"{r.throughput_tok_s:.0f}", f"{r.throughput_tok_s / base.throughput_tok_s:.2f}",
                  f"{r.p50_trajectory_s:.0f}", f"{r.p99_trajectory_s:.0f}", str(r.migrations),
                  str(r.reconfigurations), f"{r.prefix_cache_hit_rate:.0%}",
                  _f(r.rank_corr), _f(r.tail_recall), f"{r.wall_s:.1f}", *extra)
    return t


def _weights_cells(r: Result) -> list[str]:
    w = r.weights
    if w is None:
        return ["-"] * 6
    return [str(int(w["updates"])), f"{w['paused_s']:.0f}", f"{w['mean_staleness']:.2f}",
            str(int(w["max_staleness"])), f"{w['stale_token_frac']:.0%}",
            str(int(w["spanning_calls"]))]


def _schedule(sc: Scenario) -> str:
    if sc.weight_update_every_s is None:
        return ""
    return (f", weight update every {sc.weight_update_every_s:g} s, "
            f"{sc.weight_update_mode}, {sc.weight_update_s:g} s each")
