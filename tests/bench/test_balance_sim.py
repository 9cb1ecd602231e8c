"""Context balancing inside the discrete-event simulator: real engines, real tool gaps."""

from __future__ import annotations

from bench.simulator.des import SimConfig, Simulator
from bench.simulator.speeds import profiles, speeds
from bench.simulator.steps import generate_step
from gateway.policies.base import Migrate, Prediction, Snapshot, TrajectoryView
from gateway.policies.compose import ComposedPolicy
from gateway.policies.placement import FCFS, StickyPlacer
from gateway.policies.resources import ContextBalancer, UniformPlanner


class _Recorder(ContextBalancer):
    """Notes the context on both sides of every move it decides."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[int, int, int]] = []  # (source ctx, target ctx, own ctx)

    def decide(self, snap: Snapshot, traj: TrajectoryView, pred: Prediction | None,
               target: str | None) -> Migrate | None:
        before = {i: c for i, (_, c) in self.loads(snap).items()}
        move = super().decide(snap, traj, pred, target)
        if move is not None:
            self.moves.append((before[traj.instance or ""], before[move.target],
                               traj.context_tokens))
        return move


def test_moves_in_the_simulator_go_from_more_context_to_less() -> None:
    profs = profiles("qwen3-14b", "H100", None, 8)
    specs = generate_step("search", 1, 0, prompts=4)  # 64 trajectories of 16 per group
    balancer = _Recorder()
    policy = ComposedPolicy("verl-balanced", FCFS(), StickyPlacer(), UniformPlanner(8),
                            None, balancer)
    sim = Simulator(specs, policy, SimConfig(16, profs, speeds(profs), seed=1))
    sim.run()
    assert balancer.moves, "no move on a search batch whose contexts diverge"
    assert sim.stats.migrations == len(balancer.moves)
    for source, target, _own in balancer.moves:
        # from the instance holding more context to one holding less, by more than the
        # mover carries in most cases (sequence counts weigh in too)
        assert target < source
    assert sum(t + own < s for s, t, own in balancer.moves) >= len(balancer.moves) / 2
