"""``rollout-gateway bench headroom``: can one gateway process keep up with a large pool?

Two measurements, then arithmetic, all in one run:

1. **Demand.** The discrete-event simulator runs each workload of ``workloads.json`` at
   its own batch size on ``--gpus`` simulated GPUs and records when every call becomes
   ready (the moment a harness would send it). Per GPU: the mean call rate over the batch
   and the peak over ``window_s`` windows after the first (the first holds every
   trajectory's first call, a burst the gateway queues; it is reported apart). A larger
   pool runs a proportionally larger batch (the same trajectories per GPU), so its rate
   is the per-GPU rate times its GPUs;
   ``--check-gpus`` reruns one workload at twice the pool and twice the batch to show the
   per-GPU rate holds.
2. **Supply.** One gateway process (``python -m gateway serve``, traces ON into Postgres,
   pinned to one core) in front of the benchmark's fast upstream, driven closed-loop at
   saturation for each workload's median output length (a streamed call relays one SSE
   event per token, so long answers cost more gateway CPU than short ones). Its achieved
   rate and CPU per call at that length are what one process supplies on one core.

Processes needed = peak demand / one process's saturation rate (rounded up).

3. **What splitting costs.** Several gateway processes (docs/scaling.md) each own a
   share of the GPUs and the trajectories of whole groups. The simulator runs one batch
   on ``2 x gpus`` GPUs under one scheduler, then the same batch split by trajectory hash
   into ``shards`` halves, each on its own ``gpus`` GPUs; the batch ends when the slowest
   shard does. The makespan ratio is the price of scheduling in shards.
"""

from __future__ import annotations

import math
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import procs
from bench.runners.overhead import OverheadOptions, Target, machine, postgres_db, server_pid
from bench.simulator.des import SimConfig, Simulator
from bench.simulator.run import Bench, Scenario
from bench.simulator.sharded import Rebalancing, run_shards
from bench.workloads import load_workloads
from gateway.policies.registry import get_policy

Progress = Callable[[str], None]


@dataclass
class HeadroomOptions:
    workloads: list[str] = field(default_factory=lambda: ["swe", "search", "math-code",
                                                          "tau"])
    gpus: int = 64
    check_gpus: int | None = 128
    pools: list[int] = field(default_factory=lambda: [512, 2048])
    policy: str = "slime"
    seed: int = 1
    prompts: int | None = None  # fewer prompts than the workload's (smoke runs)
    window_s: float = 10.0
    shards: int = 2  # 0: skip the sharding measurement
    rebalance: Rebalancing | None = None  # also the split with the front's rebalancer
    saturation_s: float = 6.0
    concurrency: int = 64
    server_cpus: str | None = "0"
    side_cpus: str | None = "1"
    pg_admin: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    out: Path = Path("artifacts/bench/headroom")


def demand(workload: str, gpus: int, opts: HeadroomOptions, scale: int = 1) -> dict[str, Any]:
    """Call rates of one simulated batch: mean and peak, whole pool and per GPU."""
    table = load_workloads()[workload]
    sc = Scenario(workload, gpus=gpus, seed=opts.seed,
                  prompts=(opts.prompts or table["prompts"]) * scale)
    bench = Bench(sc)
    sim = _simulator(bench.specs, bench, gpus, opts)
    started = time.perf_counter()
    makespan = sim.run()
    times = sim.stats.call_times
    buckets: dict[int, int] = {}
    for t in times:
        k = int(t // opts.window_s)
        buckets[k] = buckets.get(k, 0) + 1
    # every trajectory's first call arrives at once when the batch starts: a burst the
    # gateway queues, reported apart; the peak is over the windows after it
    burst = buckets.pop(0, 0)
    peak = max(buckets.values(), default=0) / opts.window_s
    output = sum(s.total_output for s in bench.specs)
    return {"workload": workload, "gpus": gpus, "trajectories": len(bench.specs),
            "calls": len(times), "makespan_s": makespan,
            "mean_rps": len(times) / makespan, "peak_rps": peak,
            "start_burst_calls": burst,
            "mean_rps_per_gpu": len(times) / makespan / gpus, "peak_rps_per_gpu": peak / gpus,
            "output_tokens_per_call": output / len(times),
            "median_output_tokens": table["output_tokens_per_turn"]["ln"][0],
            "sim_wall_s": time.perf_counter() - started}


def _simulator(specs: list[Any], bench: Bench, gpus: int, opts: HeadroomOptions) -> Simulator:
    cfg = SimConfig(gpus, bench.profiles, bench.speeds, seed=opts.seed)
    return Simulator(specs, get_policy(opts.policy, seed=opts.seed), cfg)


def sharding(workload: str, opts: HeadroomOptions) -> dict[str, Any]:
    """One scheduler over ``shards x gpus`` GPUs vs ``shards`` schedulers over ``gpus``
    GPUs each, the batch split by trajectory hash, as HAProxy splits it (a group's
    members land on several shards)."""
    table = load_workloads()[workload]
    n = opts.shards
    whole = Bench(Scenario(workload, gpus=n * opts.gpus, seed=opts.seed,
                           prompts=(opts.prompts or table["prompts"]) * n))
    one = _simulator(whole.specs, whole, n * opts.gpus, opts).run()
    parts: list[list[Any]] = [[] for _ in range(n)]
    for spec in whole.specs:
        parts[zlib.crc32(spec.id.encode()) % n].append(spec)
    shard = Bench(Scenario(workload, gpus=opts.gpus, seed=opts.seed, prompts=1))
    each = [_simulator(part, shard, opts.gpus, opts).run() if part else 0.0 for part in parts]
    out = {"workload": workload, "shards": n, "gpus_per_shard": opts.gpus,
           "trajectories": len(whole.specs), "per_shard": [len(p) for p in parts],
           "one_scheduler_s": one, "shard_makespans_s": each,
           "sharded_s": max(each), "ratio": max(each) / one}
    if opts.rebalance is not None:
        run = run_shards([_simulator(part, shard, opts.gpus, opts) for part in parts],
                         opts.rebalance)
        out |= {"rebalanced_s": run["makespan_s"], "rebalanced_ratio": run["makespan_s"] / one,
                "rebalanced_shard_makespans_s": run["shard_makespans_s"],
                "moves": run["moves"]}
    return out


def supply(tokens: list[int], opts: HeadroomOptions, say: Progress) -> dict[int, Any]:
    """One gateway process at closed-loop saturation, per output length."""
    out: dict[int, Any] = {}
    key = "sk-bench-headroom"
    with tempfile.TemporaryDirectory() as tmp, \
            procs.fast_upstream(opts.side_cpus, Path(tmp) / "upstream.log") as upstream, \
            postgres_db(opts.pg_admin, "rg_bench_headroom") as db_url:
        env = {"ROLLOUT_GATEWAY_DISPATCH__CAP_PER_GPU": "4096",
               "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH": str(Path(tmp) / "spool.jsonl")}
        with procs.gateway(upstream, db_url, opts.server_cpus, env=env,
                           log=Path(tmp) / "gateway.log") as url:
            target = Target("gateway", url, [f"authorization: Bearer {key}"], server_pid(url))
            for n in tokens:
                say(f"gateway saturation at {n} output tokens per call")
                o = OverheadOptions(max_tokens=n, side_cpus=opts.side_cpus,
                                    server_cpus=opts.server_cpus)
                target.step(o, duration=2.0, concurrency=opts.concurrency)  # warm
                step = target.step(o, duration=opts.saturation_s,
                                   concurrency=opts.concurrency)
                out[n] = {"achieved_rps": step["achieved_rps"], "errors": step["errors"],
                          "cpu_ms_per_call": step.get("server_cpu_ms_per_call"),
                          "p50_ms": step["all"]["p50_ms"], "p99_ms": step["all"]["p99_ms"]}
    return out


def run_headroom(opts: HeadroomOptions, say: Progress, command: str) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    doc: dict[str, Any] = {"command": command, "machine": machine(),
                           "options": {"gpus": opts.gpus, "policy": opts.policy,
                                       "seed": opts.seed, "window_s": opts.window_s,
                                       "pools": opts.pools,
                                       "concurrency": opts.concurrency},
                           "demand": {}, "check": None, "supply": {}, "pools": {}}
    for w in opts.workloads:
        say(f"simulating {w} on {opts.gpus} GPUs")
        doc["demand"][w] = demand(w, opts.gpus, opts)
    if opts.check_gpus:
        w = opts.workloads[0]
        say(f"simulating {w} on {opts.check_gpus} GPUs (linearity check)")
        doc["check"] = demand(w, opts.check_gpus, opts, scale=opts.check_gpus // opts.gpus)
    if opts.shards:
        w = opts.workloads[0]
        say(f"simulating {w}: one scheduler vs {opts.shards} shards")
        doc["sharding"] = sharding(w, opts)
    tokens = sorted({int(d["median_output_tokens"]) for d in doc["demand"].values()})
    doc["supply"] = {str(k): v for k, v in supply(tokens, opts, say).items()}
    for w, d in doc["demand"].items():
        one = doc["supply"][str(int(d["median_output_tokens"]))]
        rows = {}
        for n in opts.pools:
            peak = d["peak_rps_per_gpu"] * n
            rows[str(n)] = {"mean_rps": d["mean_rps_per_gpu"] * n, "peak_rps": peak,
                            "processes": math.ceil(peak / one["achieved_rps"])
                            if one["achieved_rps"] else None}
        doc["pools"][w] = rows
    doc["wall_s"] = time.time() - started
    return doc


def headroom_markdown(doc: dict[str, Any]) -> str:
    o = doc["options"]
    lines = ["Command:", "", "```", doc["command"], "```", "",
             f"Demand: the simulator, {o['gpus']} simulated GPUs, policy `{o['policy']}`, seed "
             f"{o['seed']}, each workload at its own batch size; peak = most calls ready in "
             f"one {o['window_s']:g} s window after the first (which holds the start burst, "
             "every trajectory's first call).", "",
             "| workload | trajectories | calls | makespan (s) | start burst (calls) | "
             "mean calls/s per GPU | peak calls/s per GPU | output tokens per call |",
             "|---|---|---|---|---|---|---|---|"]
    for w, d in doc["demand"].items():
        lines.append(f"| {w} | {d['trajectories']} | {d['calls']} | {d['makespan_s']:.0f} | "
                     f"{d['start_burst_calls']} | {d['mean_rps_per_gpu']:.3f} | "
                     f"{d['peak_rps_per_gpu']:.3f} | {d['output_tokens_per_call']:.0f} |")
    c = doc.get("check")
    if c:
        base = doc["demand"][c["workload"]]
        lines += ["", f"Per-GPU rate check: {c['workload']} on {c['gpus']} GPUs with "
                  f"{c['trajectories']} trajectories: mean {c['mean_rps_per_gpu']:.3f}, peak "
                  f"{c['peak_rps_per_gpu']:.3f} calls/s per GPU (vs {base['mean_rps_per_gpu']:.3f}"
                  f" / {base['peak_rps_per_gpu']:.3f} on {base['gpus']})."]
    m = doc["machine"]
    lines += ["", f"Supply: one gateway process on one core ({m['cpu']}; load average at start "
              f"{', '.join(f'{x:.1f}' for x in m['load_avg_at_start'])}), traces ON into "
              f"Postgres, closed loop with {o['concurrency']} calls in flight, streamed and "
              "non-streamed alternating:", "",
              "| output tokens per call | calls/s | gateway CPU per call (ms) | p50 (ms) | "
              "p99 (ms) | errors |", "|---|---|---|---|---|---|"]
    for n, s in doc["supply"].items():
        cpu = s["cpu_ms_per_call"]
        lines.append(f"| {n} | {s['achieved_rps']:.0f} | {'-' if cpu is None else f'{cpu:.2f}'}"
                     f" | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['errors']} |")
    pools = list(next(iter(doc["pools"].values())))
    lines += ["", "Pools (same trajectories per GPU as above):", "",
              "| workload | " + " | ".join(f"{n} GPUs: mean / peak calls/s, processes"
                                          for n in pools) + " |",
              "|---|" + "---|" * len(pools)]
    for w, rows in doc["pools"].items():
        cells = [f"{r['mean_rps']:.0f} / {r['peak_rps']:.0f}, {r['processes']}"
                 for r in rows.values()]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    sh = doc.get("sharding")
    if sh:
        lines += ["", f"Sharding ({sh['workload']}, {sh['trajectories']} trajectories, policy "
                  f"`{o['policy']}`): one scheduler over {sh['shards'] * sh['gpus_per_shard']} "
                  f"GPUs {sh['one_scheduler_s']:.0f} s; {sh['shards']} shards of "
                  f"{sh['gpus_per_shard']} GPUs (groups split by hash: "
                  f"{', '.join(map(str, sh['per_shard']))} trajectories) "
                  f"{', '.join(f'{x:.0f}' for x in sh['shard_makespans_s'])} s, so "
                  f"{sh['sharded_s']:.0f} s: {sh['ratio']:.3f}x."]
    lines += ["", f"Wall time {doc['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"
