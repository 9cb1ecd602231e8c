"""The TP trade-off of the simulator's cost model: Libra's anchors and its move with load."""

from __future__ import annotations

import random

from backends.sim.profiles import load_profile
from bench.runners.fidelity import LIBRA, libra, pool_throughput
from bench.simulator.run import Bench, Scenario


def test_all_reduce_is_additive_and_grows_with_tokens_and_tp() -> None:
    p1, p2, p8 = (load_profile("qwen3-14b", "H100", tp) for tp in (1, 2, 8))
    assert p1.tp_comm_ms(256) == 0.0
    # 2 all-reduces x 40 layers x 10 us at one token: ~0.8 ms per step
    assert 0.79 < p8.tp_comm_ms(1) < 0.82
    assert p8.tp_comm_ms(4096) > p8.tp_comm_ms(1) and p8.tp_comm_ms(64) > p2.tp_comm_ms(64)
    base = p8.step_ms(num_tokens=64, decode_ctx_tokens=64_000)
    assert abs(base - p8.tp_comm_ms(64) - (
        p8.T0_ms + (p8.W_ms ** 2 + (p8.K_ms_per_tok * 64) ** 2) ** 0.5
        + p8.A_ms_per_1k_ctx * 64)) < 1e-9


def test_libra_short_and_long_numbers_within_twenty_percent() -> None:
    got = libra([0.0])["default"]
    assert got["max_abs_err"] < 0.2, got
    short, long_ = got["tok_s"]["short"], got["tok_s"]["long"]
    assert short["8xTP1"] / short["1xTP8"] > 2.0  # Libra: 3.1x
    assert long_["8xTP1"] / long_["1xTP8"] < 0.6  # Libra: 0.35
    assert set(got["tok_s"]) == set(LIBRA)


def test_equal_total_load_moves_the_winner_from_tp8_to_tp1() -> None:
    """Same work in flight on the same 8 GPUs: TP8 wins light, TP1 wins heavy."""
    rng = random.Random(5)
    ratios = {}
    for load in (1, 128):
        reqs = [(rng.randint(100, 1000), rng.randint(100, 1000)) for _ in range(16 * load)]
        ratios[load] = (pool_throughput(1, 0.0, reqs, load)
                        / pool_throughput(8, 0.0, reqs, 8 * load))
    assert ratios[1] < 0.7 and ratios[128] > 1.2, ratios


def test_static_layouts_in_the_simulator_follow_the_load() -> None:
    """bench sim itself: a lightly loaded pool finishes sooner at TP8 than at TP1 relative
    to a heavily loaded one (the ratio TP1/TP8 makespan falls as load grows)."""
    ratio = {}
    for prompts in (1, 16):
        b = Bench(Scenario("math-code", gpus=8, prompts=prompts, group_size=16, seed=3))
        ratio[prompts] = b.run("slime-tp1").makespan_s / b.run("slime-tp8").makespan_s
    assert ratio[16] < ratio[1], ratio
