"""Libra's causal prefix tree as its code builds it (gateway/policies/libra.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from gateway.policies.base import Phase, Prediction, Slots, TrajectoryView
from gateway.policies.libra import LIBRA_CONFIGS, LibraTree
from gateway.policies.placement import CMLFQPlacer
from gateway.policies.registry import get_policy
from tests.policies.fakes import call, inst, snapshot, traj


def run(tree: LibraTree, tid: str, prompt_id: str, turns: list[tuple[int, int, str]],
        first_prompt: int = 100) -> int:
    """Feed one trajectory the way both drivers do; ``turns`` = (output, observation,
    tool state) per call (the last call's observation and state are ignored). Returns
    its total of output + observation tokens."""
    view = TrajectoryView(tid, "g", prompt_id, 0.0, 0, 0, 0)
    prompt, gen, outcomes = first_prompt, 0, ()
    tree.observe(view, {}, 0.0)  # the first call arrives
    for k, (out, obs, state) in enumerate(turns):
        gen += out
        view = replace(view, turns=k + 1, context_tokens=prompt + out, generated_tokens=gen,
                       last_output_tokens=out, outcomes=outcomes, phase=Phase.TOOL)
        tree.observe(view, {}, 0.0)  # the call returned
        if k == len(turns) - 1:
            break
        outcomes = (*outcomes, state)
        prompt += out + obs
        view = replace(view, outcomes=outcomes, phase=Phase.QUEUED)
        tree.observe(view, {}, 0.0)  # the next call arrived with the tool's result
    tree.observe(replace(view, phase=Phase.FINISHED), {}, 0.0)
    return prompt + turns[-1][0] - first_prompt


def test_lengths_count_tool_observations_as_libra_does() -> None:
    tree = LibraTree()
    total = run(tree, "t", "p", [(50, 30, "search:small:success"), (40, 0, "")])
    assert total == 120  # 50 + 30 + 40, as Libra's segments[1:]
    probe = TrajectoryView("x", "g", "p", 0.0, 1, 150, 50, 50)
    assert tree.predict(probe, snapshot(0.0, [], [])) == Prediction(120.0, 120.0)
    after = replace(probe, outcomes=("search:small:success",))
    # remaining after the first tool return: 120 - (50 + 30) = 40
    assert tree.predict(after, snapshot(0.0, [], [])).mean == pytest.approx(40.0)


def test_mean_over_every_visit_and_p90_over_the_last_200() -> None:
    tree = LibraTree()
    lengths = [10_000] * 50 + list(range(1, 201))  # 250 trajectories, one leaf state
    for k, n in enumerate(lengths):
        run(tree, f"t{k}", "p", [(n, 0, "")])
    pred = tree.predict(TrajectoryView("x", "g", "p", 0.0, 0, 0, 0), snapshot(0.0, [], []))
    assert pred.mean == pytest.approx(sum(lengths) / len(lengths))
    assert pred.p90 == pytest.approx(float(np.percentile(range(1, 201), 90)))


def test_lookup_prefers_the_prompt_then_the_global_root_and_stops_at_the_deepest_match(
) -> None:
    tree = LibraTree()
    run(tree, "a", "p1", [(1000, 0, "bash:small:failure"), (9000, 0, "")])
    run(tree, "b", "p2", [(100, 0, "bash:small:success"), (100, 0, "")])
    snap = snapshot(0.0, [], [])
    own = tree.predict(TrajectoryView("x", "g", "p1", 0.0, 0, 0, 0), snap)
    assert own.mean == 10_000  # p1's own root, not the global mean
    unseen = tree.predict(TrajectoryView("y", "g", "p9", 0.0, 0, 0, 0), snap)
    assert unseen.mean == pytest.approx((10_000 + 200) / 2)  # the global root
    deeper = TrajectoryView("z", "g", "p1", 0.0, 2, 0, 0,
                            outcomes=("bash:small:failure", "never:seen:state"))
    assert tree.predict(deeper, snap).mean == 9000  # the matched depth-1 node


def test_no_history_moves_nothing() -> None:
    tree = LibraTree()
    t = traj("x", turns=1, outcomes=("search:small:success",))
    pred = tree.predict(t, snapshot(0.0, [], []))
    assert pred.mean == 0.0 and math.isinf(pred.p90)
    placer = CMLFQPlacer(LIBRA_CONFIGS["search"].thresholds)
    instances = [inst("t2", 2), inst("t4", 4), inst("t8", 8)]
    snap = snapshot(0.0, instances, [t])
    assert placer.choose(call("x"), t, pred, Slots.of(snap), snap) == "t2"


def test_search_config_is_libras_search_r1_layout() -> None:
    policy = get_policy("libra-search")
    assert sorted(policy.planner.initial_layout(16)) == [2, 2, 4, 8]  # its 16-GPU config
    assert sorted(policy.planner.initial_layout(64)) == [2] * 8 + [4] * 4 + [8] * 4
    assert sorted(get_policy("libra").planner.initial_layout(8)) == [1, 1, 2, 4]
