"""The rebalancer's rule (gateway/shards/rebalance.py ``choose``), without processes: when
an engine moves, which one, and that a move never empties a shard, always lowers the
worse of the two shards' calls per GPU, never moves the engine it just moved back, and
that looks at the same load settle."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.shards.fanout import split_gpus
from gateway.shards.rebalance import Engine, Move, ShardLoad, choose, load_of


def shard(i: int, calls: float, *tps: int, busy: tuple[int, ...] = ()) -> ShardLoad:
    engines = tuple(Engine(f"e{k}", tp, busy[k] if k < len(busy) else 0, True)
                    for k, tp in enumerate(tps))
    return ShardLoad(i, sum(tps), calls, engines)


def test_an_idle_shard_gives_its_least_busy_smallest_engine_to_the_busy_one() -> None:
    loads = [shard(0, 40, 1, 1, 1, 1), shard(1, 2, 2, 1, 1, busy=(0, 3, 1))]
    move = choose(loads, ratio=2.0, min_calls=8)
    assert move is not None
    assert (move.shard, move.backend, move.to) == (1, "e2", 0)  # TP1, 1 call beats 3
    assert "shard 0: 10.0 calls/GPU" in move.reason


def test_no_move_when_it_does_not_pay() -> None:
    busy = shard(0, 40, 1, 1, 1, 1)
    assert choose([busy, shard(1, 30, 1, 1, 1, 1)], 2.0, 8) is None  # under the ratio
    assert choose([shard(0, 6, 1, 1), shard(1, 0, 1, 1)], 2.0, 8) is None  # few calls
    assert choose([busy, shard(1, 0, 4)], 2.0, 8) is None  # its last engine stays
    assert choose([busy], 2.0, 8) is None
    # the light shard would end busier than the busy one is now
    worse = [shard(0, 12, 1, 1, 1, 1), shard(1, 3, 1, 1)]  # 3.0 vs 1.5: the ratio is met
    assert worse[0].pressure == 2.0 * worse[1].pressure
    assert choose(worse, 2.0, 8) is None  # but shard 1 would be at 3.0 on one GPU
    not_ready = ShardLoad(1, 2, 0, (Engine("e0", 1, 0, True), Engine("e1", 1, 0, False)))
    move = choose([busy, not_ready], 2.0, 8)
    assert move is not None and move.backend == "e0"  # only a ready one moves


def test_a_shard_with_calls_and_no_gpus_is_the_busiest() -> None:
    loads = [ShardLoad(0, 0, 5, ()), shard(1, 1, 1, 1)]
    assert math.isinf(loads[0].pressure)
    move = choose(loads, 2.0, 4)
    assert move is not None and (move.shard, move.to) == (1, 0)


def test_load_comes_from_a_shards_status() -> None:
    status = {"backends": [
        {"id": "tp1-g0", "tp": 1, "gpus": [0], "routable": True, "state": "ready",
         "in_flight": 3},
        {"id": "b1", "tp": 2, "gpus": [], "routable": True, "state": "ready", "in_flight": 0},
        {"id": "tp1-g1", "tp": 1, "gpus": [1], "routable": False, "state": "draining"}]}
    load = load_of(2, status, 6.0)
    assert (load.shard, load.gpus, load.calls) == (2, 3, 6.0)
    assert [e.id for e in load.engines] == ["tp1-g0", "b1"]
    assert load.pressure == 2.0


tps = st.lists(st.sampled_from([1, 1, 2, 4]), min_size=1, max_size=6)


def moved(loads: list[ShardLoad], move: Move, name: str) -> list[ShardLoad]:
    """``loads`` once ``move`` is done, the engine renamed ``name`` where it lands."""
    light, heavy = loads[move.shard], loads[move.to]
    engine = next(e for e in light.engines if e.id == move.backend)
    out = list(loads)
    out[heavy.shard] = ShardLoad(heavy.shard, heavy.gpus + engine.tp, heavy.calls,
                                 (*heavy.engines, Engine(name, engine.tp, 0, True)))
    out[light.shard] = ShardLoad(light.shard, light.gpus - engine.tp, light.calls,
                                 tuple(e for e in light.engines if e.id != engine.id))
    return out


def layout_of(loads: list[ShardLoad]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Each shard's GPUs and the TPs of its engines: what a move changes."""
    return tuple((s.gpus, tuple(sorted(e.tp for e in s.engines))) for s in loads)


@given(st.lists(st.tuples(st.floats(0, 500), tps), min_size=2, max_size=4),
       st.floats(1.1, 4), st.integers(1, 20))
def test_moves_lower_the_worse_pressure_never_move_an_engine_back_and_settle(
        shards: list[tuple[float, list[int]]], ratio: float, min_calls: int) -> None:
    """The same load looked at again and again: each move lowers the busiest shard's calls
    per GPU on both ends, the engine just moved stays where it went, no layout comes back
    and the moves end. A next move may go the other way with another engine, where the
    first could only overshoot (4 calls on one GPU, 6 on two TP2s: a TP2 moves, 1.3 and
    3.0; then the TP1 goes back, 2.0 and 2.0), so the direction alone is no property."""
    loads = [shard(i, calls, *t) for i, (calls, t) in enumerate(shards)]
    seen = {layout_of(loads)}
    last = None
    for k in range(64):
        move = choose(loads, ratio, min_calls)
        if move is None:
            return
        light, heavy = loads[move.shard], loads[move.to]
        assert len(light.engines) >= 2 and move.shard != move.to
        assert move.backend != last  # never straight back
        loads, last = moved(loads, move, f"moved{k}"), f"moved{k}"
        assert max(loads[heavy.shard].pressure, loads[light.shard].pressure) < heavy.pressure
        assert layout_of(loads) not in seen, "a layout came back"
        seen.add(layout_of(loads))
    raise AssertionError("the moves did not settle in 64 looks")


def test_an_overshooting_move_is_followed_by_one_that_evens_out() -> None:
    loads = [shard(0, 4, 1), shard(1, 6, 2, 2)]
    first = choose(loads, 2.0, 1)
    assert first is not None and (first.shard, first.to) == (1, 0)
    after = moved(loads, first, "moved")
    assert (after[0].pressure, after[1].pressure) == (4 / 3, 3.0)
    second = choose(after, 2.0, 1)
    assert second is not None and (second.shard, second.backend, second.to) == (0, "e0", 1)
    even = moved(after, second, "back")
    assert [s.pressure for s in even] == [2.0, 2.0]
    assert choose(even, 2.0, 1) is None


def test_a_resize_splits_by_what_each_shard_holds() -> None:
    assert split_gpus(8, [4, 4]) == [4, 4]
    assert split_gpus(4, [1, 5]) == [1, 3]
    assert split_gpus(3, [1, 5]) == [1, 2]
    assert split_gpus(0, [2, 2]) == [0, 0]
    with pytest.raises(ValueError, match="between 0 and 6"):
        split_gpus(7, [1, 5])


@given(st.lists(st.integers(0, 64), min_size=1, max_size=8), st.data())
def test_a_split_adds_up_and_fits(sizes: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(0, sum(sizes)))
    out = split_gpus(k, sizes)
    assert sum(out) == k and all(0 <= g <= s for g, s in zip(out, sizes, strict=True))
