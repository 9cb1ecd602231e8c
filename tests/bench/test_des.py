"""Workload generator and discrete-event simulator: determinism and driver invariants."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import typer
from typer.testing import CliRunner

from bench.cli import bench_app
from bench.simulator.des import SimConfig, Simulator
from bench.simulator.run import Bench, Scenario
from bench.simulator.speeds import profiles, speeds
from bench.workloads import generate
from gateway.policies.base import (
    Dispatch,
    GroupView,
    Migrate,
    PendingCall,
    Phase,
    Policy,
    Prediction,
    Relayout,
    Snapshot,
    TrajectoryView,
)
from gateway.policies.registry import get_policy

TINY = Scenario("swe", gpus=8, prompts=3, group_size=4)


def test_workloads_are_deterministic_and_group_correlated() -> None:
    a, b = generate("swe", 7), generate("swe", 7)
    assert a == b and generate("swe", 8) != a
    assert len(a) == 512
    by_group: dict[str, list[int]] = {}
    for s in a:
        by_group.setdefault(s.group_id, []).append(s.total_output)
    within = statistics.mean(statistics.pstdev(v) for v in by_group.values())
    across = statistics.pstdev([s.total_output for s in a])
    assert within < across  # siblings share a difficulty
    assert all(s.total_output <= 32768 for s in a)


def test_swe_timeouts_are_labelled() -> None:
    states = [t.tool_state for s in generate("swe", 1) for t in s.turns if t.tool_state]
    timeouts = sum(s.endswith(":timeout") for s in states) / len(states)
    assert 0.01 < timeouts < 0.06


class Recording:
    """Wraps a policy; checks the driver's side of the contract as it goes."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name, self.label = inner.name, inner.label
        self.dispatched: list[str] = []
        self.gaps = 0
        self.first_seen: dict[str, float] = {}  # trajectory -> first snapshot time
        self.finished_seen: dict[str, float] = {}  # trajectory -> observe(FINISHED) time
        self.members_seen: set[str] = set()

    @property
    def plan_interval_s(self) -> float | None:
        return self.inner.plan_interval_s

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        return self.inner.initial_layout(gpus)

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        if traj.phase is Phase.FINISHED:
            self.finished_seen[traj.id] = now
        for g in groups.values():
            self.members_seen.update(g.members)
        self.inner.observe(traj, groups, now)

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction | None:
        return self.inner.predict(traj, snap)

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        for tid in snap.trajectories:
            self.first_seen.setdefault(tid, snap.now)
        out = self.inner.schedule(snap, pending)
        self.dispatched += [d.key for d in out]
        return out

    def on_tool_gap(self, snap: Snapshot, traj: TrajectoryView) -> Migrate | None:
        assert traj.phase is Phase.TOOL  # migrations are only ever decided in tool gaps
        self.gaps += 1
        return self.inner.on_tool_gap(snap, traj)

    def plan(self, snap: Snapshot) -> Relayout | None:
        return self.inner.plan(snap)


def _sim(name: str) -> tuple[Simulator, Recording, float]:
    bench = Bench(TINY)
    truth = {s.id: s.total_output for s in bench.specs}
    rec = Recording(get_policy(name, oracle_truth=lambda t, g: truth[t] - g))
    profs = profiles("qwen3-14b", "H100")
    sim = Simulator(bench.specs, rec, SimConfig(8, profs, speeds(profs)))
    return sim, rec, sim.run()


def test_every_call_dispatched_exactly_once_and_all_finish() -> None:
    for name in ("slime", "progressive"):
        sim, rec, _ = _sim(name)
        calls = sum(len(s.turns) for s in (t.spec for t in sim.trajs.values()))
        assert len(rec.dispatched) == len(set(rec.dispatched)) == calls
        assert all(t.finished_at is not None for t in sim.trajs.values())
        # the gateway cannot tell a last call from any other: every call ends in a gap
        assert rec.gaps == calls


def test_trajectories_appear_on_arrival_and_end_at_finish() -> None:
    """Policies see what a live gateway sees: nothing of a trajectory before its first
    call arrives, and its end only with the client's /finish, after its last call."""
    for name in ("slime", "heddle"):
        sim, rec, _ = _sim(name)
        setups = sorted({t.spec.setup_s for t in sim.trajs.values()})
        assert len(setups) > 1  # staggered arrivals, or the check below proves nothing
        for tid, t in sim.trajs.items():
            if tid in rec.first_seen:
                assert rec.first_seen[tid] >= t.spec.setup_s
            assert t.finished_at is not None
            assert rec.finished_seen[tid] > t.finished_at  # /finish after the last return
        assert rec.members_seen == set(sim.trajs)


def test_simulation_is_deterministic_for_a_seed() -> None:
    a, b = _sim("heddle"), _sim("heddle")
    assert a[2] == b[2] and a[0].stats.migrations == b[0].stats.migrations


class RaisesOnOneCall(Recording):
    """Raises on any batch holding one given call (a policy bug that hits one entry)."""

    def __init__(self, inner: Policy, key: str) -> None:
        super().__init__(inner)
        self.key = key

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        if any(c.key == self.key for c in pending):
            raise KeyError(self.key)
        return super().schedule(snap, pending)


def test_a_policy_raising_on_one_call_fails_that_call_and_the_run_completes() -> None:
    """The simulator runs the gateway's step: the call the policy raises on alone fails,
    its trajectory ends there (the harness gives it up), every other call is served."""
    bench = Bench(TINY)
    bad = next(s for s in bench.specs if len(s.turns) > 2)
    rec = RaisesOnOneCall(get_policy("slime"), f"{bad.id}#1")
    profs = profiles("qwen3-14b", "H100")
    sim = Simulator(bench.specs, rec, SimConfig(8, profs, speeds(profs)))
    assert sim.run() > 0
    assert sim.stats.failed_calls == 1 and sim.trajs[bad.id].turn == 1
    others = sum(len(s.turns) for s in bench.specs if s.id != bad.id)
    assert len(rec.dispatched) == len(set(rec.dispatched)) == others + 1
    assert all(t.finished_at is not None for t in sim.trajs.values())
    assert rec.finished_seen.keys() == sim.trajs.keys()


def _cli() -> typer.Typer:
    """The bench group as ``rollout-gateway`` mounts it (``rollout_gateway.cli``)."""
    root = typer.Typer()
    root.add_typer(bench_app, name="bench")
    return root


def test_cli_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    res = CliRunner().invoke(_cli(), [
        "bench", "sim", "--workload", "math-code", "--gpus", "4", "--prompts", "2", "--group-size",
        "4", "--policy", "slime", "--policy", "progressive", "--policy", "progressive-oracle", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    for name in ("slime", "progressive", "progressive-oracle"):
        r = doc["results"][name]
        assert r["makespan_s"] >= r["lower_bound_makespan_s"] * 0.999
        for key in ("throughput_tok_s", "p50_trajectory_s", "p99_trajectory_s", "migrations",
                    "reconfigurations"):
            assert key in r
    assert doc["results"]["progressive-oracle"]["label"] == "progressive + perfect predictor"


def test_cli_rejects_unknown_policy() -> None:
    res = CliRunner().invoke(_cli(), ["bench", "sim", "--policy", "nope", "--prompts", "1"])
    assert res.exit_code != 0 and "available" in res.output
