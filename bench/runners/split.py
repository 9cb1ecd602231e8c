"""``rollout-gateway bench split``: what scheduling in shards costs in makespan.

A sharded gateway (docs/scaling.md) places a call only on its own shard's GPUs. Per seed
and workload, the simulator runs one batch under one scheduler over ``shards x gpus``
GPUs, and the same batch split by trajectory hash (as HAProxy splits it) into ``shards``
schedulers of ``gpus`` GPUs each; the batch ends when the slowest shard does. The ratio
(sharded over one scheduler) is reported as the geometric mean over seeds with a 95%
interval, seeds paired (the same batch on both sides).

With ``opts.rebalance`` the split runs a third time with the front's rebalancer moving
instances between the shards on one clock (:mod:`bench.simulator.sharded`: the live
rule, a drain and an engine start per move), paired with the other two.
"""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from bench.runners.headroom import HeadroomOptions, sharding
from bench.simulator.steps import interval
from bench.workloads import load_workloads


def _one(args: tuple[str, HeadroomOptions]) -> dict[str, Any]:
    workload, opts = args
    return sharding(workload, opts)


def run_split(workloads: list[str], seeds: range, opts: HeadroomOptions, per_gpu: int,
              jobs: int = 2) -> dict[str, Any]:
    table = load_workloads()
    todo = []
    for w in workloads:
        prompts = max(1, per_gpu * opts.gpus // table[w]["group_size"])
        todo += [(w, replace(opts, seed=s, prompts=prompts)) for s in seeds]
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        runs = list(ex.map(_one, todo))
    out: dict[str, Any] = {}
    for w in workloads:
        mine = [r for r in runs if r["workload"] == w]
        out[w] = {"seeds": len(mine), **_paired(mine, "ratio"),
                  "one_scheduler_s": [r["one_scheduler_s"] for r in mine],
                  "sharded_s": [r["sharded_s"] for r in mine],
                  "per_shard": [r["per_shard"] for r in mine]}
        if opts.rebalance is not None:
            out[w]["rebalanced"] = {
                **_paired(mine, "rebalanced_ratio"),
                "over_sharded": _paired([{"x": r["rebalanced_s"] / r["sharded_s"]}
                                         for r in mine], "x"),
                "rebalanced_s": [r["rebalanced_s"] for r in mine],
                "moves": [r["moves"] for r in mine]}
    return out


def _paired(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The geometric mean of ``key`` over seeds and its 95% interval."""
    m, h = interval([math.log(r[key]) for r in runs])
    return {"ratio_geomean": math.exp(m), "ci95": [math.exp(m - h), math.exp(m + h)]}
