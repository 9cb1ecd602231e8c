"""Context balancing: a long trajectory leaves an instance crowded with KV context."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backends.sim.profiles import load_profile
from gateway.dispatch.speeds import fit_speed, speeds_for
from gateway.policies.base import Phase, Prediction, Snapshot
from gateway.policies.resources import ContextBalancer
from tests.policies.fakes import inst, snapshot, traj


def _pool(crowd: int, crowd_ctx: int, light: int) -> tuple[Snapshot, list[str]]:
    """``crowd`` trajectories of ``crowd_ctx`` context on ``a``, ``light`` small ones on
    ``b``, and the trajectory ``t`` (40k context, in its tool gap) on ``a``."""
    trajs = [traj(f"h{i}", instance="a", context=crowd_ctx, phase=Phase.GENERATING)
             for i in range(crowd)]
    trajs += [traj(f"l{i}", instance="b", context=2000) for i in range(light)]
    trajs.append(traj("t", instance="a", context=40000, generated=20000, phase=Phase.TOOL))
    snap = snapshot(0.0, [inst("a", 8, running=crowd, cap=256),
                          inst("b", 8, running=light, cap=256)], trajs)
    return replace(snap, speeds=speeds_for("qwen3-14b/H100")), [t.id for t in trajs]


def test_the_batch_step_fit_follows_the_latency_model_where_agentic_batches_run() -> None:
    prof = load_profile("qwen3-14b", "H100", 8)
    fit = fit_speed(prof)
    for n, ctx in ((64, 64 * 16000), (128, 128 * 30000), (200, 200 * 8000)):
        truth = prof.step_ms(num_tokens=n, decode_ctx_tokens=ctx) / 1000
        assert fit.batch_step_s(n, ctx) == pytest.approx(truth, rel=0.05)


def test_a_long_trajectory_leaves_an_instance_crowded_with_context() -> None:
    snap, _ = _pool(crowd=12, crowd_ctx=50000, light=12)
    t = snap.trajectories["t"]
    move = ContextBalancer().decide(snap, t, None, None)
    assert move is not None and move.target == "b"


def test_no_move_when_the_loads_are_even_or_the_rest_is_too_short_to_pay() -> None:
    snap, _ = _pool(crowd=12, crowd_ctx=2000, light=12)  # same context both sides
    t = snap.trajectories["t"]
    assert ContextBalancer().decide(snap, t, None, None) is None
    crowded, _ = _pool(crowd=12, crowd_ctx=50000, light=12)
    t = crowded.trajectories["t"]
    # predicted to end within a few tokens: the re-prefill would cost more than it saves
    assert ContextBalancer().decide(crowded, t, Prediction(5, 0), None) is None


def test_an_excluded_instance_is_never_a_target() -> None:
    snap, _ = _pool(crowd=12, crowd_ctx=50000, light=12)
    balancer = ContextBalancer()
    balancer.exclude = frozenset({"b"})
    assert balancer.decide(snap, snap.trajectories["t"], None, None) is None


def _even_pool(phase: Phase, n: int = 20, context: int = 6000) -> Snapshot:
    """Two TP2 instances: ``a`` holds 20 decoding trajectories of 7000 tokens and ``t``
    (6000, in its tool gap), ``b`` holds ``n`` of ``context`` tokens in ``phase``."""
    trajs = [traj(f"a{i}", instance="a", context=7000, phase=Phase.GENERATING)
             for i in range(20)]
    trajs += [traj(f"b{i}", instance="b", context=context, phase=phase) for i in range(n)]
    trajs.append(traj("t", instance="a", context=6000, generated=2000, phase=Phase.TOOL))
    running = n if phase is Phase.GENERATING else 0
    snap = snapshot(0.0, [inst("a", 2, running=20, cap=256),
                          inst("b", 2, running=running, cap=256)], trajs)
    return replace(snap, speeds=speeds_for("qwen3-14b/H100"))


def test_the_re_prefill_is_charged_to_the_calls_it_delays_on_the_target() -> None:
    # the step saved pays twice the mover's own re-prefill, so it moves to an instance
    # whose trajectories sit in their tool gaps
    idle = _even_pool(Phase.TOOL)
    move = ContextBalancer().decide(idle, idle.trajectories["t"], None, None)
    assert move is not None and move.target == "b"
    # the same context decoding there: twenty calls as long as the mover would wait
    # out its re-prefill, which the step saved does not pay
    busy = _even_pool(Phase.GENERATING)
    assert ContextBalancer().decide(busy, busy.trajectories["t"], None, None) is None
    # calls on shorter trajectories (less likely to set the makespan) are not charged
    short = _even_pool(Phase.GENERATING, n=24, context=5000)
    move = ContextBalancer().decide(short, short.trajectories["t"], None, None)
    assert move is not None and move.target == "b"
