"""Shards on one simulated clock with the front's rebalancer (bench/simulator/sharded.py):
instances move to the shard whose calls wait, a move costs a drain (the calls on the
instance finish there) and an engine start, no GPU is lost or made, every trajectory
ends, and a skewed batch ends sooner than without the moves."""

from __future__ import annotations

from typing import Any

from bench.simulator.des import SimConfig, Simulator
from bench.simulator.run import Bench, Scenario
from bench.simulator.sharded import Rebalancing, run_shards
from gateway.policies.registry import get_policy

GPUS = 8


def shards(parts: list[list[Any]], bench: Bench) -> list[Simulator]:
    return [Simulator(p, get_policy("slime", tp=1),  # eight TP1 instances a shard
                      SimConfig(GPUS, bench.profiles, bench.speeds, seed=1)) for p in parts]


def skewed(share: float) -> tuple[list[list[Any]], Bench]:
    bench = Bench(Scenario("math-code", gpus=2 * GPUS, seed=3, prompts=24))
    cut = int(len(bench.specs) * share)
    return [bench.specs[:cut], bench.specs[cut:]], bench


def test_a_skewed_batch_ends_sooner_with_instances_moved_to_its_shard() -> None:
    parts, bench = skewed(0.9)
    plain = run_shards(shards(parts, bench))
    sims = shards(parts, bench)
    moved = run_shards(sims, Rebalancing(interval_s=5.0, cooldown_s=5.0))
    assert plain["moves"] == []
    assert moved["moves"], moved
    assert all(m["from"] == 1 and m["to"] == 0 and m["landed"] for m in moved["moves"])
    for m in moved["moves"]:  # a drain, then an engine start on the other shard
        assert m["at"] <= m["drained_at"] and m["up_at"] == round(
            m["drained_at"] + sims[1].cfg.restart_s, 1)
    assert all(s.finished == len(s.trajs) for s in sims)
    assert sum(s.cfg.gpus for s in sims) == 2 * GPUS  # no GPU lost or made
    assert [s.cfg.gpus for s in sims] == [GPUS + len(moved["moves"]),
                                          GPUS - len(moved["moves"])]
    assert sum(i.tp for i in sims[0].instances.values()) == sims[0].cfg.gpus
    assert moved["shard_makespans_s"][0] < plain["shard_makespans_s"][0]
    print(f"skewed 90/10: shard 0 {plain['shard_makespans_s'][0]:.0f} s -> "
          f"{moved['shard_makespans_s'][0]:.0f} s with {len(moved['moves'])} moves")


def test_a_busy_instance_drains_before_it_moves_and_loses_no_call() -> None:
    parts, bench = skewed(0.7)
    sims = shards(parts, bench)
    run = run_shards(sims, Rebalancing(interval_s=2.0, ratio=1.5, min_calls=2,
                                       cooldown_s=2.0))
    assert any(m["drained_at"] > m["at"] for m in run["moves"]), run["moves"]
    assert all(s.finished == len(s.trajs) for s in sims)
    assert sum(s.stats.failed_calls for s in sims) == 0
    calls = sum(s.stats.calls for s in sims)
    assert calls == sum(len(t.spec.turns) for s in sims for t in s.trajs.values())


def test_balanced_shards_move_nothing() -> None:
    parts, bench = skewed(0.5)
    run = run_shards(shards(parts, bench), Rebalancing(interval_s=5.0))
    assert len(run["moves"]) <= 1, run["moves"]  # the tail of one shard, at most
