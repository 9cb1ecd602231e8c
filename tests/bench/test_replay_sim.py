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
