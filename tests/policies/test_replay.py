"""``replay``: the bulk TP chosen each step by replaying the last step on each layout."""

from __future__ import annotations

import math

import pytest

from gateway.policies.base import Phase, Relayout, TPSpeed
from gateway.policies.compose import ComposedPolicy
from gateway.policies.registry import get_policy
from gateway.policies.replay import ReplayPlanner, StepRecorder, Turn, replay_makespan
from tests.policies.fakes import inst, snapshot, traj

# Two pools that differ only in how well TP scales. A step costs fixed + seq*n + ctx*C.
# "poor": TP8 is barely faster than TP1 per instance (vLLM 0.5.4-like), so eight TP1s
# serve a busy step far faster; "good": TP8 decodes ~8x faster, so it wins everywhere.
POOR = {1: TPSpeed(0.010, 0.01, 1e-5, 0.010, 1e-4, 1e-8, kv_tokens=400_000),
        8: TPSpeed(0.008, 0.01, 1e-5, 0.008, 0.8e-4, 0.8e-8, kv_tokens=4_000_000)}
GOOD = {1: POOR[1], 8: TPSpeed(0.0013, 0.01, 1e-6, 0.0013, 1.3e-5, 1.3e-9,
                                kv_tokens=4_000_000)}


def _busy_step(n: int = 64) -> list[list[Turn]]:
    """``n`` equal trajectories of three calls each, 2 s tools in between."""
    return [[Turn(1000, 300, 0.0), Turn(200, 300, 2.0), Turn(200, 300, 2.0)]
            for _ in range(n)]


def test_recorder_rebuilds_each_call_from_what_the_gateway_observed() -> None:
    rec = StepRecorder()
    first = traj("t", turns=1, context=1100)
    rec.observe(_with(first, last_output_tokens=100))
    second = traj("t", turns=2, context=1500)  # 300 tool tokens, 100 more generated
    rec.observe(_with(second, last_output_tokens=100, tool_time_s=2.5))
    rec.observe(_with(traj("t", turns=2, context=1500), last_output_tokens=100,
                      tool_time_s=2.5, phase=Phase.FINISHED))
    rec.close()
    assert rec.sample == [[Turn(1000, 100, 0.0), Turn(300, 100, 2.5)]]
    # the RL loop reuses the id next step: a fresh trajectory, not a continuation
    rec.observe(_with(traj("t", turns=1, context=900), last_output_tokens=50))
    rec.observe(_with(traj("t", turns=1, context=900), last_output_tokens=50,
                      phase=Phase.FINISHED))
    rec.close()
    assert rec.sample == [[Turn(850, 50, 0.0)]]


def test_a_step_that_never_closes_keeps_its_latest_trajectories() -> None:
    """Rollouts that never pause (an asynchronous step mode) never close a step: the
    recorder keeps the latest finished trajectories, not all of them."""
    rec = StepRecorder(max_sample=3)
    for k in range(10):
        rec.observe(_with(traj(f"t{k}", turns=1, context=100 + k), last_output_tokens=10))
        rec.observe(_with(traj(f"t{k}", turns=1, context=100 + k), last_output_tokens=10,
                          phase=Phase.FINISHED))
    rec.close()
    assert [t[0].new_tokens for t in rec.sample] == [97, 98, 99]


def _with(view: object, **changes: object) -> object:
    from dataclasses import replace
    return replace(view, **changes)  # type: ignore[type-var]


def test_the_replay_ranks_layouts_as_the_speeds_say() -> None:
    busy = _busy_step(64)
    # poor TP scaling: a busy step runs far faster on eight TP1 instances than on one TP8
    assert replay_makespan(busy, (1,) * 8, POOR) < 0.9 * replay_makespan(busy, (8,), POOR)
    # good TP scaling: one TP8 wins the same step
    assert replay_makespan(busy, (8,), GOOD) < replay_makespan(busy, (1,) * 8, GOOD)
    # one long trajectory alone: its decode speed is the makespan, so TP8 wins either way
    lone = [[Turn(1000, 4000, 0.0)]]
    assert replay_makespan(lone, (8,), POOR) < replay_makespan(lone, (1,) * 8, POOR)


def test_the_replay_counts_tools_and_prefill_not_only_decoding() -> None:
    one = [[Turn(0, 100, 0.0), Turn(0, 100, 30.0)]]  # a 30 s tool between two calls
    assert replay_makespan(one, (1,), POOR) > 30.0
    assert replay_makespan([[Turn(100_000, 1, 0.0)]], (1,), POOR) >= 100_000 * 1e-5


def test_a_call_that_does_not_fit_the_kv_cache_rules_the_layout_out() -> None:
    huge = [[Turn(500_000, 100, 0.0)]]
    assert math.isinf(replay_makespan(huge, (1,), POOR))
    assert not math.isinf(replay_makespan(huge, (8,), POOR))


def test_siblings_on_one_instance_share_their_first_prompt() -> None:
    """A GRPO group's members arrive together and share their prompt: on one instance
    it is prefilled once, spread over eight it is prefilled eight times. Without the
    cache in the replay, spreading looked no costlier, which biased it to low TP."""
    group = [[Turn(20_000, 10, 0.0)] for _ in range(8)]
    same = ["g"] * 8
    alone = replay_makespan(group[:1], (1,), POOR)  # one prefill of 20k tokens: 0.2 s
    one = replay_makespan(group, (1,), POOR, prompts=same)
    assert alone <= one < 1.2 * alone  # one prefill, eight short decodes
    # strangers (every prompt its own) pay eight prefills on one instance
    strangers = replay_makespan(group, (1,), POOR, prompts=[str(i) for i in range(8)])
    assert strangers > 5 * one
    # eight instances, one sibling each: no sharing, each prefills it
    assert replay_makespan(group, (1,) * 8, POOR, prompts=same) == pytest.approx(alone)


def test_a_context_parked_in_a_tool_gap_is_prefilled_again_when_kv_runs_short() -> None:
    """Back from its tool, a trajectory finds its context cached only as far as the
    decoders left room for the parked contexts; the rest is prefilled again."""
    small = {1: _with(POOR[1], kv_tokens=120_000)}  # type: ignore[dict-item]
    roomy = {1: _with(POOR[1], kv_tokens=10_000_000)}  # type: ignore[dict-item]
    # ten trajectories of 20k context each: 200k held, the engine has room for 120k
    step = [[Turn(20_000, 1, 0.0), Turn(100, 1, 1.0 + 0.01 * i)] for i in range(10)]
    prompts = [str(i) for i in range(10)]
    tight = replay_makespan(step, (1,), small, prompts=prompts)  # type: ignore[arg-type]
    loose = replay_makespan(step, (1,), roomy, prompts=prompts)  # type: ignore[arg-type]
    redo = tight - loose
    # the first returns to 180k parked against 120k of room: a third of its context is
    # prefilled again, more for the later ones as the decoders take room
    assert redo > 20_000 / 3 * POOR[1].prefill_s_per_token
    assert redo < 10 * 20_000 * POOR[1].prefill_s_per_token


def test_the_recorder_keeps_arrival_order_and_first_prompts() -> None:
    """verl's routing deals trajectories round robin in arrival order, siblings in a
    row: the sample keeps that order (not the order they finished in) and each one's
    first prompt (its identity, not its group label: a client may label a whole batch
    one group)."""
    rec = StepRecorder()
    arrivals = (("a", "p1", 1100), ("b", "p1", 1200), ("c", "p2", 1300))
    for tid, prompt, ctx in arrivals:
        rec.observe(_with(traj(tid, turns=1, context=ctx), prompt_id=prompt, group_id="g",
                          last_output_tokens=100))
    for tid, prompt, ctx in reversed(arrivals):  # finish out of order
        rec.observe(_with(traj(tid, turns=1, context=ctx), prompt_id=prompt, group_id="g",
                          last_output_tokens=100, phase=Phase.FINISHED))
    rec.close()
    assert rec.prompts == ["p1", "p1", "p2"]
    assert [t[0].new_tokens for t in rec.sample] == [1000, 1100, 1200]


def _run_step(policy: ComposedPolicy, n: int, speeds: dict[int, TPSpeed]) -> None:
    """What a driver does in one step: plan calls (they carry the speeds), then every
    trajectory's calls observed until it finishes."""
    snap = snapshot(0.0, [inst("a", tp=8, cap=256), inst("b", tp=8, cap=256)], [])
    policy.plan(_speeds(snap, speeds))
    for i in range(n):
        ctx = 1000
        for turn in range(1, 4):
            ctx += 300 if turn > 1 else 0
            view = traj(f"t{i}", turns=turn, context=ctx + 300)
            phase = Phase.FINISHED if turn == 3 else Phase.TOOL
            policy.observe(_with(view, last_output_tokens=300, tool_time_s=2.0 * (turn - 1),
                                 phase=phase), {}, float(turn))  # type: ignore[arg-type]
            ctx += 300


def _speeds(snap: object, speeds: dict[int, TPSpeed]) -> object:
    return _with(snap, speeds=speeds, total_gpus=16)


def test_the_layout_follows_the_measured_speeds_from_step_to_step() -> None:
    policy = get_policy("replay")
    assert isinstance(policy, ComposedPolicy) and isinstance(policy.planner, ReplayPlanner)
    planner = policy.planner
    assert policy.initial_layout(16) == (8, 4, 2, 1, 1)  # nothing observed: every degree
    _run_step(policy, 128, POOR)
    assert policy.initial_layout(16) == (1,) * 16  # TP scales poorly: many small instances
    assert planner.estimates[1] < planner.estimates[8]
    _run_step(policy, 128, GOOD)
    assert policy.initial_layout(16) == (8, 8)  # the engines got faster at TP8: back


def test_a_live_pool_is_relaid_out_once_idle_and_never_mid_step() -> None:
    policy = get_policy("replay")
    assert isinstance(policy, ComposedPolicy)
    _run_step(policy, 128, POOR)  # a whole step observed; the pool still runs 2 x TP8
    busy = snapshot(0.0, [inst("a", tp=8, cap=256, running=3), inst("b", tp=8, cap=256)],
                    [traj("x", turns=1, phase=Phase.GENERATING)])
    assert policy.plan(_speeds(busy, POOR)) is None  # a trajectory is running: wait
    idle = snapshot(0.0, [inst("a", tp=8, cap=256), inst("b", tp=8, cap=256)], [])
    change = policy.plan(_speeds(idle, POOR))
    assert change == Relayout(("a", "b"), (1,) * 16, change.reason if change else "")
    assert change is not None and "TP1" in change.reason


def test_a_step_closes_once_its_abandoned_trajectory_expired() -> None:
    """A harness that died leaves its trajectory in a tool gap for good. The driver
    forgets it after an idle time (gateway/trajectories/expiry.py) and the policy learns
    that from the snapshot alone, where it is no longer: the step closes without it, and
    its partial turns are no part of the sample the next layout is chosen on."""
    policy = get_policy("replay")
    assert isinstance(policy, ComposedPolicy) and isinstance(policy.planner, ReplayPlanner)
    _run_step(policy, 128, POOR)
    abandoned = _with(traj("gone", turns=1, context=60_000), last_output_tokens=50_000,
                      phase=Phase.TOOL)
    policy.observe(abandoned, {}, 4.0)  # type: ignore[arg-type]
    pool = [inst("a", tp=8, cap=256), inst("b", tp=8, cap=256)]
    for now in (10.0, 1e4, 1e6):  # not yet expired: it may come back, however long
        waiting = snapshot(now, pool, [abandoned])  # type: ignore[list-item]
        assert policy.plan(_speeds(waiting, POOR)) is None
    expired = snapshot(1e6, pool, [])
    change = policy.plan(_speeds(expired, POOR))
    assert change is not None and change.launch == (1,) * 16, change
    assert len(policy.planner.recorder.sample) == 128  # the finished ones only


def test_the_decode_step_follows_the_fitted_curve_where_the_straight_line_misses() -> None:
    from backends.sim.profiles import load_profile
    from gateway.dispatch.speeds import fit_speed

    p = load_profile("qwen3-14b", "A100", 2)
    sp = fit_speed(p)
    for n in (1, 4, 16, 64):
        assert sp.decode_step_s(n, 0) == pytest.approx(p.step_ms(num_tokens=n) / 1000)
    # between two points: linear; at a few sequences the line through 64 and 128 is
    # well below the weight-streaming floor the curve keeps
    mid = sp.decode_step_s(3, 0)
    assert sp.decode_step_s(2, 0) <= mid <= sp.decode_step_s(4, 0)
    assert sp.batch_step_s(4, 0) < 0.9 * sp.decode_step_s(4, 0)
    assert sp.decode_step_s(1000, 0) == pytest.approx(sp.batch_step_s(1000, 0))
    ctx = 10_000
    assert sp.decode_step_s(4, ctx) - sp.decode_step_s(4, 0) == pytest.approx(sp.ctx_s * ctx)


def test_a_lane_is_only_carved_out_where_the_replay_says_it_pays() -> None:
    """64 GPUs: the straggler lane fits, but where one TP8 instance decodes a lone
    sequence slower than TP1 (poorly scaling TP), putting the longest trajectories on it
    slows them: the replay drops the lane and runs all-TP1."""
    slow8 = {1: POOR[1], 8: TPSpeed(0.02, 0.01, 1e-5, 0.02, 1e-4, 1e-8, kv_tokens=4_000_000)}
    policy = get_policy("replay")
    assert isinstance(policy, ComposedPolicy) and isinstance(policy.planner, ReplayPlanner)
    planner = policy.planner
    # step 1: the lane, beside the probe of every degree
    assert policy.initial_layout(64) == (8,) * 7 + (4, 2, 1, 1) and planner.lane_on
    planner.joined_lane("t255", 0)  # the lane caught the last finisher: its rule keeps it
    _run_step(policy, 256, slow8)
    assert policy.initial_layout(64) == (1,) * 64
    assert not planner.lane_on and planner.lane_estimates[1] > planner.estimates[1]


# two GPUs: TP2 decodes a little faster than two TP1s serve the step ("near"), or far
# faster ("far"); TP1's speed borrowed from TP2's measurement either way
NEAR = {1: POOR[1], 2: TPSpeed(0.008, 0.01, 1e-5, 0.008, 0.8e-4, 0.8e-8, kv_tokens=800_000)}
FAR = {1: POOR[1], 2: TPSpeed(0.001, 0.01, 1e-6, 0.001, 1e-5, 1e-9, kv_tokens=800_000)}


def _two_gpu_step(policy: ComposedPolicy, layout: tuple[int, ...], speeds: dict[int, TPSpeed],
                  borrowed: frozenset[int]) -> Relayout | None:
    """One step on ``layout`` of a live two-GPU pool, then the plan of the idle pool."""
    pool = [inst(f"i{k}", tp=tp, cap=64) for k, tp in enumerate(layout)]
    snap = _with(snapshot(0.0, pool, []), speeds=speeds, total_gpus=2, borrowed=borrowed)
    policy.plan(snap)  # type: ignore[arg-type]
    for i in range(16):
        for turn in range(1, 4):
            view = traj(f"t{i}", turns=turn, context=1000 + 600 * turn)
            policy.observe(_with(view, last_output_tokens=300, tool_time_s=2.0 * (turn - 1),
                                 phase=Phase.FINISHED if turn == 3 else Phase.TOOL),
                           {}, float(turn))  # type: ignore[arg-type]
    return policy.plan(snap)  # type: ignore[arg-type]


def test_a_degree_no_engine_measured_is_run_once_where_its_estimate_comes_near() -> None:
    """A live pool of two GPUs holds one TP2 or two TP1s, never both: on TP2 alone, TP1's
    speed is TP2's correction lent to the profile. Where TP1's estimate on that comes within
    1.6x of TP2's, the next step runs on TP1 to measure it, once; then the measured speeds
    decide. Far from it, the pool stays."""
    policy = get_policy("replay")
    assert isinstance(policy, ComposedPolicy) and isinstance(policy.planner, ReplayPlanner)
    change = _two_gpu_step(policy, (2,), NEAR, borrowed=frozenset({1}))
    est = policy.planner.estimates
    assert est[2] < est[1] <= 1.6 * est[2], est  # TP2 first, TP1 near enough to measure
    assert change is not None and change.launch == (1, 1), change
    assert "measuring TP1" in change.reason
    # measured now, TP1 is as the profile says: TP2 wins and the pool goes back
    change = _two_gpu_step(policy, (1, 1), NEAR, borrowed=frozenset())
    assert change is not None and change.launch == (2,) and "fastest" in change.reason
    # TP1 is not measured again, even where a later step's speeds lend it TP2's factor
    assert _two_gpu_step(policy, (2,), NEAR, borrowed=frozenset({1})) is None

    far = get_policy("replay")
    assert isinstance(far, ComposedPolicy) and isinstance(far.planner, ReplayPlanner)
    assert _two_gpu_step(far, (2,), FAR, borrowed=frozenset({1})) is None
    assert far.planner.estimates[1] > 1.6 * far.planner.estimates[2]
