"""Step modes on real vLLM (CPU build, tiny model): the asynchronous and over-provisioned
modes of ``gateway.client.StepRunner`` with real weight updates between steps (two
checkpoints taking turns), every trained token's recorded version checked by recomputing
its logprob under each checkpoint, and the staleness each mode promises held."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from backends.base import LaunchedInstance
from gateway.app import create_app
from gateway.client import AsyncRolloutClient, StepBatch, StepMode, StepRunner
from tests.gateway.conftest import make_settings
from tests.servers import LoopThread, app_in_thread
from tests.vllm.truth import SERVED_NAME, recompute, reload_weights

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
KEY = "harness-key"
TIE = 0.05  # logprobs closer than this under both checkpoints do not tell which made it


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


def prompts() -> Iterator[dict[str, int]]:
    k = 0
    while True:  # every other prompt a straggler: long enough to span an update
        yield {"id": k, "tokens": 400 if k % 2 else 40}
        k += 1


def launcher(gw: AsyncRolloutClient) -> Any:
    async def launch(tid: str, gid: str, prompt: dict[str, int]) -> float:
        messages: list[Any] = [{"role": "user", "content": f"task {prompt['id']}"}]
        async with AsyncOpenAI(base_url=gw.base_url_for(tid, gid), api_key=KEY,
                               max_retries=0, timeout=600) as llm:
            for turn in range(2):
                r = await llm.chat.completions.create(
                    model=SERVED_NAME, messages=messages, max_tokens=prompt["tokens"],
                    temperature=1.0, extra_body={"ignore_eos": True})
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": f"tool said {turn}"}]
        return 1.0
    return launch


async def run(url: str, mode: StepMode, checkpoints: dict[str, str], first: int,
              steps: int, path_of: dict[str, str]) -> list[StepBatch]:
    out = []
    async with AsyncRolloutClient(url, admin_token="tok") as gw, \
            StepRunner(gw, launcher(gw), prompts(), batch=2, group_size=2, mode=mode,
                       run_id=f"real-{mode.mode}") as runner:
        for k in range(steps):
            out.append(await runner.next_batch(timeout_s=900))
            version = str(first + k + 1)
            path_of[version] = checkpoints["B" if (first + k) % 2 == 0 else "A"]
            job = await gw.update_weights(version, weights_path=path_of[version],
                                          mode="abort-and-continue", timeout_s=600)
            assert job.status == "succeeded", job
        await gw.set_max_staleness(None)
    return out


async def judge(engine: str, batches: list[StepBatch], path_of: dict[str, str],
                checkpoints: dict[str, str]) -> tuple[int, int, int]:
    """(generated tokens, stamped with the weights that made them, ties)."""
    samples = [s for b in batches for s in b.samples]
    under: dict[str, list[list[float]]] = {}
    for name, path in checkpoints.items():
        await reload_weights(engine, path)
        under[name] = [await recompute(engine, s.token_ids) for s in samples]
    names = {path: name for name, path in checkpoints.items()}
    total = right = ties = 0
    for k, s in enumerate(samples):
        for i, (mask, v) in enumerate(zip(s.loss_mask, s.weight_versions, strict=True)):
            if not mask:
                continue
            dist = {c: abs(under[c][k][i - 1] - s.logprobs[i]) for c in checkpoints}
            best = min(dist, key=lambda c, d=dist: d[c])
            tie = max(dist.values()) - dist[best] < TIE
            total += 1
            ties += tie
            right += tie or names[path_of[v]] == best
    return total, right, ties


@pytest.mark.timeout(2400)
async def test_async_and_overprovisioned_steps_train_true_versions_on_real_vllm(
        tp1_server: LaunchedInstance, loop_thread: LoopThread, checkpoints: dict[str, str],
        tmp_path: Path) -> None:
    engine = tp1_server.url
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/s.db", [engine],
                             admin_token="tok", api_keys=[KEY], weight_version="0")
    await reload_weights(engine, checkpoints["A"])
    path_of = {"0": checkpoints["A"]}
    t0 = time.monotonic()
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        async with AsyncRolloutClient(url, admin_token="tok") as gw:
            await gw.set_weight_version("0")
        batches = {
            "async": await run(url, StepMode("async", max_staleness=1), checkpoints, 0, 3,
                               path_of),
            "overprovisioned": await run(url, StepMode("overprovisioned", over=0.5),
                                         checkpoints, 3, 3, path_of)}
    wall = time.monotonic() - t0
    for mode, bs in batches.items():
        lags = [dict(b.lag_tokens) for b in bs]
        print(f"real vLLM {mode}: trained tokens by version lag per step {lags}, "
              f"restarts {bs[-1].restarts}, aborted {bs[-1].aborted}")
        assert all(len(b.groups) == 2 and len(b.samples) == 4 for b in bs)
        assert max(b.max_staleness for b in bs) <= 1
        assert all(s.reward == 1.0 for b in bs for s in b.samples)
    assert any(b.lag_tokens.get(1) for bs in batches.values() for b in bs), \
        "no trained token crossed an update: the modes were not exercised"
    total, right, ties = await judge(engine, [b for bs in batches.values() for b in bs],
                                     path_of, checkpoints)
    print(f"real vLLM step modes: {right}/{total} trained tokens stamped with the weights "
          f"that made them ({ties} ties), {wall:.0f} s")
    assert right == total > 0
