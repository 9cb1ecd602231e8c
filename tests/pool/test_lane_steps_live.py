"""``straggler-lane`` learns per RL step; a live gateway has no call that says a step began, so
the policy must see the step end from what the gateway observes: every trajectory of the
batch finished. Two steps through a managed sim pool that reuse the trajectory ids."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from gateway.policies.compose import ComposedPolicy
from gateway.policies.lane import LanePlanner, StepLoad
from tests.pool.conftest import PoolGateway
from tests.pool.test_id_reuse import _rollout
from tests.pool.test_pool_sim import client, ready_pool, sim_spec

IDS = [(f"p{p}-{s}", f"p{p}") for p in range(3) for s in range(3)]


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "the step never ended"
        await asyncio.sleep(0.05)


async def _step(c: httpx.AsyncClient, planner: LanePlanner, step: int,
                before: StepLoad | None) -> StepLoad:
    """Run one RL step; the step the planner closed once the batch was over."""
    await asyncio.wait_for(asyncio.gather(
        *(_rollout(c, tid, group, step) for tid, group in IDS)), 60)
    await _until(lambda: planner.last is not None and planner.last is not before
                 and planner.current.trajectories == 0)
    closed = planner.last
    assert closed is not None and closed.trajectories == len(IDS)
    assert closed.last_id in dict(IDS)
    # the switch for the next step follows the step that just ended
    assert planner.lane_on == closed.lane_caught_straggler
    return closed


async def test_a_live_gateway_closes_each_rl_step_for_the_lane(
        pool_gateway: PoolGateway) -> None:
    # four TP1 instances: a lane of one GPU is a quarter of the pool, so the lane runs
    with pool_gateway(sim_spec(gpus=4), cap_per_gpu=2, policy="straggler-lane",
                      tick_s=0.02, time_scale=20) as gw:
        policy = gw.rt.dispatcher.scheduler.policy
        assert isinstance(policy, ComposedPolicy) and isinstance(policy.planner, LanePlanner)
        planner = policy.planner
        async with client(gw) as c:
            await ready_pool(c)
            first = await _step(c, planner, 0, None)
            assert first.lane_joins  # the lane ran: trajectories were put on it
            second = await _step(c, planner, 1, first)
            assert second is not first
            status = (await c.get("/status")).json()["scheduler"]
            assert status["faults"] == 0 and status["queued"] == 0, status
