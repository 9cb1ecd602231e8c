"""Step modes through a live gateway (gateway/client/steps.py): OpenAI-client agents on two
simulated engines slow enough that weight updates land mid-generation. Every mode hands
the trainer whole groups, and every trained token's version is within what the mode
promises: on-policy for sync, tail batching and dropping over-provisioning; at most the
bound for carried and asynchronous steps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.client import AsyncRolloutClient, StepMode, StepRunner
from gateway.client.errors import GatewayConnectionError
from tests.gateway.conftest import make_settings
from tests.gateway.slow_engines import KEY, MODEL, two_slow_engines
from tests.servers import LoopThread, app_in_thread, forget_updates_of

B, G = 3, 3


@pytest.fixture(scope="module")
def slow_urls(loop_thread: LoopThread) -> Iterator[list[str]]:
    yield from two_slow_engines(loop_thread)


def prompts() -> Iterator[dict[str, int]]:
    k = 0
    while True:  # every third prompt is a straggler
        yield {"id": k, "turns": 2, "tokens": 120 if k % 3 == 2 else 12}
        k += 1


def agent(gw: AsyncRolloutClient) -> Any:
    async def launch(tid: str, gid: str, prompt: dict[str, int]) -> float:
        messages: list[Any] = [{"role": "user", "content": f"task {prompt['id']}"}]
        async with AsyncOpenAI(base_url=gw.base_url_for(tid, gid), api_key=KEY,
                               max_retries=0) as llm:
            for turn in range(prompt["turns"]):
                r = await llm.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=prompt["tokens"],
                    extra_body={"ignore_eos": True})
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": f"tool said {turn}"}]
        return 1.0
    return launch


async def run_mode(url: str, mode: StepMode, steps: int = 3) -> list[Any]:
    out = []
    async with AsyncRolloutClient(url, admin_token="tok") as gw:
        async with StepRunner(gw, agent(gw), prompts(), batch=B, group_size=G,
                              mode=mode, run_id=f"t-{mode.mode}-{mode.carry}") as steps_:
            for step in range(steps):
                batch = await steps_.next_batch(timeout_s=120)
                out.append(batch)
                # a trainer whose logprobs agree with the engines': the report's plumbing
                report = await steps_.report_mismatch(
                    batch, [s.logprobs for s in batch.samples])
                out.append(report)
                await asyncio.sleep(0.2)  # the trainer trains; async rollouts go on
                await gw.pause(mode="abort-and-continue")
                await gw.resume(weight_version=str(step + 1))
        await gw.set_max_staleness(None)
    return out


@pytest.mark.parametrize(("mode", "bound"), [
    (StepMode("sync"), 0),
    (StepMode("overprovisioned", over=0.5, carry=False), 0),
    (StepMode("tail-batching", over=0.5, over_members=0.34), 0),
    (StepMode("overprovisioned", over=0.5), 1),
    (StepMode("async", max_staleness=1), 1),
    (StepMode("async", max_staleness=0), 0),
], ids=["sync", "overprovisioned-drop", "tail-batching", "overprovisioned", "async",
        "async-on-policy"])
def test_every_mode_hands_whole_groups_within_its_staleness(
        loop_thread: LoopThread, slow_urls: list[str], sqlite_url: str, mode: StepMode,
        bound: int) -> None:
    settings = make_settings(sqlite_url, slow_urls, admin_token="tok", api_keys=[KEY],
                             weight_version="0")
    forget_updates_of(loop_thread, slow_urls)  # the engines as new: the last mode's updates
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        both = asyncio.run(run_mode(url, mode))
        board = httpx.get(f"{url}/status").json()["training_mismatch"]
    batches, reports = both[::2], both[1::2]
    assert board["reports"] == len(reports) and board["alarms"] == 0
    for batch, report in zip(batches, reports, strict=True):
        # one report per step, in the runner's mode, per version the tokens were made on
        assert (report.step, report.mode, report.alarms) == (batch.step, mode.mode, [])
        versions = {s.weight_versions[i] for s in batch.samples
                    for i, m in enumerate(s.loss_mask) if m}
        assert set(report.by_version) == versions
        assert report.overall.tokens == sum(sum(s.loss_mask) for s in batch.samples)
        assert report.overall.kl == 0.0
    for k, batch in enumerate(batches, start=1):
        assert batch.step == k and batch.version == str(k - 1)
        assert len(batch.groups) == B and all(len(t) == G for t in batch.groups.values())
        assert len(batch.samples) == B * G
        trained = sum(batch.lag_tokens.values())
        generated = sum(sum(s.loss_mask) for s in batch.samples)
        assert trained == generated > 0  # every generated token carries an integer version
        assert batch.max_staleness <= bound, (k, batch.lag_tokens)
        assert all(s.reward == 1.0 for s in batch.samples)
    if mode.mode == "tail-batching":
        assert batches[-1].deferred < batches[-2].deferred  # the long round ran them
    if bound == 1:  # the carry really happened: work crossed an update and was trained
        assert any(b.lag_tokens.get(1) for b in batches)
    if mode.mode == "async" and bound == 0:
        # AReaL's rule at bound 0 admits one batch at a time: nothing is in flight across
        # an update, so nothing goes stale (tests/client/test_step_admission.py)
        assert batches[-1].restarts == 0


def test_a_member_cut_before_its_first_call_never_calls(
        loop_thread: LoopThread, slow_urls: list[str], sqlite_url: str) -> None:
    """Tail batching cuts a group's extra members once ``group_size`` are done; one that
    has not reached the gateway yet has nothing to abort there (404), so the runner
    cancels its harness: it never makes its first call and nothing is logged as lost."""
    settings = make_settings(sqlite_url, slow_urls, admin_token="tok", api_keys=[KEY],
                             weight_version="0")
    late: dict[str, bool] = {}

    async def go(url: str) -> Any:
        async with AsyncRolloutClient(url, admin_token="tok") as gw:
            fast = agent(gw)

            async def launch(tid: str, gid: str, prompt: dict[str, int]) -> float:
                if tid.endswith("-2"):  # the extra member: slow to start
                    late[tid] = False
                    await asyncio.sleep(30)
                    late[tid] = True
                return await fast(tid, gid, {**prompt, "tokens": 8})

            async with StepRunner(gw, launch, prompts(), batch=1, group_size=2,
                                  mode=StepMode("tail-batching", over=0, over_members=0.5),
                                  run_id="cut") as runner:
                batch = await runner.next_batch(timeout_s=60)
                await asyncio.sleep(0.5)
                assert runner._runs == {}  # the slow member's harness was cancelled
                return batch

    forget_updates_of(loop_thread, slow_urls)
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        batch = asyncio.run(go(url))
        (gid,) = batch.groups
        assert len(batch.groups[gid]) == 2 and f"{gid}-2" in late
        assert late[f"{gid}-2"] is False
        assert httpx.get(f"{url}/trajectories/{gid}-2",
                         headers={"Authorization": "Bearer tok"}).status_code == 404


class _Flaky(httpx.AsyncBaseTransport):
    """Sample fetches fail ``fail`` times (the gateway out of reach); the rest go through."""

    def __init__(self, fail: int) -> None:
        self.inner, self.fail = httpx.AsyncHTTPTransport(), fail

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.fail and request.url.path.endswith("/samples"):
            self.fail -= 1
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_batch_that_could_not_be_fetched_is_handed_over_next_time(
        loop_thread: LoopThread, slow_urls: list[str], sqlite_url: str) -> None:
    settings = make_settings(sqlite_url, slow_urls, admin_token="tok", api_keys=[KEY],
                             weight_version="0")

    async def go(url: str) -> tuple[Any, Any]:
        async with httpx.AsyncClient(base_url=url, transport=_Flaky(1)) as http, \
                AsyncRolloutClient(url, admin_token="tok", http=http) as gw, \
                StepRunner(gw, agent(gw), prompts(), batch=1, group_size=2,
                           run_id="flaky") as runner:
            with pytest.raises(GatewayConnectionError):
                await runner.next_batch(timeout_s=60)
            return runner, await runner.next_batch(timeout_s=60)

    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        runner, batch = asyncio.run(go(url))
    assert list(batch.groups) == ["flaky-g0"] and batch.step == 1
    assert sorted(s.trajectory_id for s in batch.samples) == ["flaky-g0-0", "flaky-g0-1"]
