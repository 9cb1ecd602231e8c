"""``replay`` in the simulator: its layout follows the cost model's TP efficiency, and it
keeps up with the best uniform static layout found by sweeping every TP."""

from __future__ import annotations

from bench.simulator.steps import StepScenario, run_steps


def _step2(policy: str, band: str) -> float:
    sc = StepScenario("math-code", policy, seed=1, steps=2, gpus=8, model="qwen3-8b",
                      prompts=16, tp_efficiency=band)
    return run_steps(sc).makespans[1]  # step 1 is cold: replay has nothing observed yet


def test_replay_finds_the_best_static_tp_at_both_ends_of_the_band() -> None:
    for band, best_tp in (("low", 1), ("calibrated", 8)):
        static = {tp: _step2(f"verl-tp{tp}", band) for tp in (1, 2, 4, 8)}
        # the premise moves: where TP scales as measured, TP1 serves this batch fastest
        assert min(static, key=lambda tp: static[tp]) == best_tp, static
        assert _step2("replay", band) <= 1.02 * static[best_tp], (band, static)


def _replay_layouts(probe: bool, beliefs: str, steps: int = 3) -> list[tuple[int, ...]]:
    """The layouts ``replay`` runs three steps on, the speeds it plans with believed as
    ``beliefs`` (``live``: what the gateway's meter knows, from the calibrated profile)."""
    from bench.simulator.des import SimConfig, Simulator
    from bench.simulator.speeds import band_profiles, live_beliefs, speeds
    from bench.simulator.steps import generate_step
    from gateway.policies.compose import ComposedPolicy
    from gateway.policies.registry import get_policy
    from gateway.policies.replay import ReplayPlanner

    profs = band_profiles("qwen3-8b", "H100", "low", 8)
    cfg = SimConfig(8, profs, speeds(profs), seed=1)
    meter = live_beliefs("qwen3-8b", "H100", 8, beliefs)
    policy = get_policy("replay")
    assert isinstance(policy, ComposedPolicy) and isinstance(policy.planner, ReplayPlanner)
    policy.planner.probe = probe
    layouts, t0 = [], 0.0
    for k in range(steps):
        sim = Simulator(generate_step("math-code", 1, k, prompts=16), policy, cfg, start_s=t0,
                        beliefs=meter)
        t0 = sim.run() + 1.0
        layouts.append(policy.planner.choice)
    return layouts


def test_with_live_beliefs_replay_finds_the_band_by_measuring_what_it_borrows() -> None:
    """The calibrated profile says TP8 serves this batch best; at the band's low end TP1
    does (the test above). Told the truth, replay moves to TP1 after one step. Believing
    only what the engines measured, a pool that ran TP8 alone lends TP8's correction to
    every degree, which keeps TP8 first: it then runs the degrees whose borrowed estimate
    comes within 1.6x of the best, one step each and each once, and ends on TP1. Probing
    every degree the first step gets there a step later than the truth."""
    assert _replay_layouts(probe=False, beliefs="true")[1:] == [(1,) * 8] * 2
    walked = _replay_layouts(probe=False, beliefs="live", steps=6)
    assert walked[0] == (8,) and walked[1] == (4, 4)  # measuring TP4, next to TP8
    assert walked[-2:] == [(1,) * 8] * 2
    # TP8 as started, then TP4 and TP2 measured a step each; never twice
    assert [lay for lay in walked if lay != (1,) * 8] == [(8,), (4, 4), (2, 2, 2, 2)]
    probed = _replay_layouts(probe=True, beliefs="live", steps=4)
    assert probed[0] == (4, 2, 1, 1)
    assert probed[1] == probed[-1] == (1,) * 8
