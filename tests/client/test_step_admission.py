"""The async step mode's admission rule over many steps (issue 44, item 2).

AReaL bounds the groups ever started by ``(steps taken + max_staleness + 1) * batch``, so
no more than ``(max_staleness + 1) * batch`` groups are ever running or waiting to be
trained. An earlier runner compared that bound with a count that left out trained groups,
so the groups in flight grew by ``batch`` every step. Here a gateway stand-in (the
runner's whole interface to the gateway, in memory: the version a trajectory started on
stamps its tokens) and agents of random length run 24 steps on several seeds; the groups
in flight are counted whenever an agent starts, and every trained token's staleness is
checked against the bound (complete groups that waited past it are rerun, as the runner
does when the gateway has not aborted them first).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from gateway.client.steps import StepMode, StepRunner
from gateway.client.types import SampleBatch
from gateway.schema.samples import CallSpan, Sample

B, G, STEPS = 4, 3, 24


class Gateway:
    """What StepRunner calls on the gateway, kept in memory."""

    def __init__(self) -> None:
        self.version = 0
        self.started: dict[str, int] = {}  # trajectory -> the version its tokens carry
        self.finished: dict[str, float | None] = {}

    async def set_max_staleness(self, bound: int | None) -> dict[str, Any]:
        return {"max_staleness": bound}

    async def finish(self, tid: str, reward: float | None, **_: Any) -> None:
        self.finished[tid] = reward

    async def trajectory(self, tid: str) -> dict[str, Any]:
        return {"metadata": {}}

    async def abort(self, tid: str, reason: str | None = None) -> None:
        return None

    async def restart(self, tid: str) -> int:
        return 1

    async def status(self) -> dict[str, Any]:
        return {"weight_version": str(self.version)}

    async def samples(self, ids: list[str]) -> SampleBatch:
        out = []
        for tid in ids:
            v = str(self.started[tid])
            out.append(Sample(trajectory_id=tid, group_id=tid.rsplit("-", 1)[0], reward=1.0,
                              token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3,
                              weight_versions=["", v, v],
                              calls=[CallSpan(0, "c", 0, 1, 3, v, "b", 1)]))
        return SampleBatch(out)


async def _run(seed: int, bound: int) -> tuple[list[int], list[int], int]:
    rng = random.Random(seed)
    gw = Gateway()
    in_flight: list[int] = []
    runner: StepRunner

    async def launch(tid: str, gid: str, prompt: int) -> float:
        in_flight.append(len(runner._groups))
        gw.started[tid] = gw.version  # its first token is made on this version
        await asyncio.sleep(rng.choice([0.001, 0.002, 0.004, 0.03]))  # a straggler now and then
        return 1.0

    staleness = []
    async with StepRunner(gw, launch, iter(range(10_000)), batch=B, group_size=G,  # type: ignore[arg-type]
                          mode=StepMode("async", max_staleness=bound),
                          run_id=f"s{seed}") as runner:
        for _ in range(STEPS):
            batch = await runner.next_batch(timeout_s=30)
            assert len(batch.groups) == B
            staleness.append(batch.max_staleness)
            await asyncio.sleep(0.005)  # the trainer trains while rollouts go on
            gw.version += 1
        restarts = runner.restarts
    return in_flight, staleness, restarts


@pytest.mark.parametrize("bound", [0, 1, 2])
@pytest.mark.parametrize("seed", range(5))
def test_async_keeps_groups_in_flight_bounded_and_tokens_within_staleness(
        seed: int, bound: int) -> None:
    in_flight, staleness, restarts = asyncio.run(_run(seed, bound))
    assert max(in_flight) <= (bound + 1) * B, in_flight
    assert max(staleness) <= bound, staleness
    if bound:  # the overlap is real: some trained tokens are behind, and groups that
        # waited past the bound were set aside and their members run again
        assert max(staleness) >= 1 and restarts > 0, (staleness, restarts)
    else:  # one batch at a time: nothing in flight across an update
        assert restarts == 0
