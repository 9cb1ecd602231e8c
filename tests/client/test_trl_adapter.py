"""``gateway.client.trl`` against a live gateway over simulated vLLM servers.

TRL itself is not run here (tests/vllm/test_trl_grpo_vllm.py trains with it on a real
engine): a stand-in with the attributes ``rollout_func`` reads plays the trainer. Checked:
the rows TRL gets are the samples (prompt before the first completion, the rest with the
loss mask as ``env_mask``), rows keep TRL's order and groups, rewards come from the
gateway, a forked trajectory is refused or one branch picked and the rest counted, and a
push saves the model and moves every engine to the next version.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.client import RolloutClient
from gateway.client.trl import GatewayGRPO, Rollout
from tests.client.conftest import ADMIN_TOKEN, MODEL, GatewayFactory

pytest.importorskip("trl")  # the extra; the dev install has it


def _trainer(generations: int, step: int = 0) -> Any:
    return SimpleNamespace(num_generations=generations, num_generations_eval=generations,
                           model=SimpleNamespace(training=True),
                           state=SimpleNamespace(global_step=step))


async def _two_turns(r: Rollout) -> float:
    messages: list[Any] = [{"role": "user", "content": f"{r.prompt} ({r.index})"}]
    async with AsyncOpenAI(base_url=r.base_url, api_key=r.api_key, max_retries=0) as llm:
        for _ in range(2):
            reply = await llm.chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=12)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "go on"}]
    return float(r.index)


async def _with_side_call(r: Rollout) -> float:
    await _two_turns(r)
    async with AsyncOpenAI(base_url=r.base_url, api_key=r.api_key, max_retries=0) as llm:
        await llm.chat.completions.create(  # a title call: a branch of its own
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "a title?"}])
    return 1.0


class _Model:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "config.json").write_text(json.dumps({"saved": True}))
        # the pool checks a checkpoint before pausing anything: it needs weight files
        (Path(path) / "model.safetensors").write_bytes(b"\0" * 16)


def test_rows_are_the_gateway_samples(gateway: GatewayFactory, sqlite_url: str,
                                      tmp_path: Path) -> None:
    with gateway(sqlite_url, admin_token=ADMIN_TOKEN) as gw_url, ExitStack() as closing:
        gw = GatewayGRPO(gw_url, _two_turns, weights_dir=tmp_path, admin_token=ADMIN_TOKEN,
                         run_id="t1")
        closing.callback(gw.close)
        prompts = ["sum 1 2", "sum 1 2", "sum 3 4", "sum 3 4"]
        rows = gw.rollout_func(prompts, _trainer(2))
        assert rows["trajectory_id"] == ["t1-s0-p0-0", "t1-s0-p0-1", "t1-s0-p1-0",
                                         "t1-s0-p1-1"]
        assert rows["gateway_reward"] == [0.0, 1.0, 0.0, 1.0]
        assert gw.reward_func(prompts, [], rows["gateway_reward"]) == [0.0, 1.0, 0.0, 1.0]
        with RolloutClient(gw_url, admin_token=ADMIN_TOKEN) as client:
            for i, tid in enumerate(rows["trajectory_id"]):
                (s,) = client.branch_samples(tid)
                n = s.num_prompt_tokens
                assert rows["prompt_ids"][i] == s.token_ids[:n]
                assert rows["completion_ids"][i] == s.token_ids[n:]
                assert rows["logprobs"][i] == s.logprobs[n:]
                assert rows["env_mask"][i] == s.loss_mask[n:]
                assert 0 in rows["env_mask"][i] and rows["env_mask"][i][0] == 1
        (record,) = gw.steps
        assert record.groups == ["t1-s0-p0", "t1-s0-p1"] and record.version == "0"
        assert record.completion_tokens > 0
        assert record.versions == {"0": record.completion_tokens}
        assert record.off_version_tokens == record.dropped_tokens == 0
        assert record.max_staleness == 0 and record.rollout_s > 0

        push = gw.push(_Model())
        assert push.version == "1" == gw.version and Path(push.path, "config.json").exists()
        assert set(push.phases) >= {"pause", "update", "resume"}
        status = httpx.get(f"{gw_url}/status", timeout=10,  # URLs for the operator only
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        assert status["weight_version"] == "1"
        for b in status["backends"]:
            info = httpx.get(f"{b['url']}/weight_info", timeout=10).json()
            assert info["weight_version"] == "1"
        rows = gw.rollout_func(prompts[:2], _trainer(2, step=1))
        assert gw.steps[-1].versions == {"1": gw.steps[-1].completion_tokens}
        again = gw.rollout_func(prompts[:2], _trainer(2, step=1))  # a second batch, same step
        assert again["trajectory_id"] == ["t1-s1-2-p0-0", "t1-s1-2-p0-1"]
        assert rows["trajectory_id"] == ["t1-s1-p0-0", "t1-s1-p0-1"]


def test_a_forked_trajectory_gives_its_task_conversation_whole(
        gateway: GatewayFactory, sqlite_url: str, tmp_path: Path) -> None:
    """Two turns, then a title call (a branch of its own): by default the row is the
    two-turn conversation, every token it generated under ``env_mask`` 1; the title's
    tokens are counted as left out. ``"error"`` still refuses, ``"longest"`` still picks."""
    with gateway(sqlite_url) as gw_url, ExitStack() as closing:
        whole = GatewayGRPO(gw_url, _with_side_call, weights_dir=tmp_path, run_id="t4")
        closing.callback(whole.close)
        rows = whole.rollout_func(["x", "x"], _trainer(2))
        for tid, mask in zip(rows["trajectory_id"], rows["env_mask"], strict=True):
            calls = httpx.get(f"{gw_url}/trajectories/{tid}", timeout=10).json()["calls"]
            task = [c for c in calls if c["branch"] == calls[0]["branch"]]
            assert len(task) == 2 and sum(mask) == sum(len(c["completion_ids"]) for c in task)
        assert whole.steps[-1].dropped_tokens > 0  # the title calls' tokens
        strict = GatewayGRPO(gw_url, _with_side_call, weights_dir=tmp_path, run_id="t2",
                             multi_branch="error")
        closing.callback(strict.close)
        with pytest.raises(ValueError, match=r"has 2 branches.*multi_branch"):
            strict.rollout_func(["x", "x"], _trainer(2))
        longest = GatewayGRPO(gw_url, _with_side_call, weights_dir=tmp_path, run_id="t3",
                              multi_branch="longest")
        closing.callback(longest.close)
        rows = longest.rollout_func(["x", "x"], _trainer(2))
        assert len(rows["completion_ids"]) == 2


@pytest.fixture(scope="module")
def lora_sim(loop_thread: Any) -> Any:
    """Two simulated vLLM servers with LoRA adapters loadable at run time."""
    from backends.sim.runner import start_sim_servers
    from backends.sim.state import SimServerConfig

    cm = start_sim_servers([SimServerConfig(speed=50, seed=i, enable_lora=True)
                            for i in range(2)])
    yield loop_thread.run(cm.__aenter__())
    loop_thread.run(cm.__aexit__(None, None, None))


async def _solve_then_verify(r: Rollout) -> float:
    """A two-role agent: the solver answers (the base model's own policy), the verifier
    (a LoRA family) judges the answer."""
    async with AsyncOpenAI(base_url=r.base_url, api_key=r.api_key, max_retries=0) as llm:
        answer = await llm.chat.completions.create(model=MODEL, max_tokens=10, messages=[
            {"role": "system", "content": "You solve."}, {"role": "user", "content": r.prompt}])
        await llm.chat.completions.create(model="verifier", max_tokens=6, messages=[
            {"role": "system", "content": "You verify."},
            {"role": "user", "content": f"{r.prompt} = {answer.choices[0].message.content}?"}])
    return 1.0


class _Lora:
    """A peft model as GatewayGRPO sees one: ``peft_config``, and ``save_pretrained``
    writing an adapter (a random one: backends.tinylora)."""

    peft_config = {"default": SimpleNamespace(peft_type="LORA")}

    def save_pretrained(self, path: Path) -> None:
        from backends.tinylora import write_adapter

        write_adapter(Path(path), seed=1)


def test_a_policy_trainer_takes_its_own_tokens_and_pushes_its_own_adapter(
        gateway: GatewayFactory, lora_sim: list[str], sqlite_url: str,
        tmp_path: Path) -> None:
    """Two policies, one pool: the verifier's trainer gets rows where only the verifier's
    tokens are trained, and its push moves the verifier's version alone."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with gateway(sqlite_url, backends=lora_sim, admin_token=ADMIN_TOKEN,
                 lora_models={"verifier": MODEL}) as gw_url, ExitStack() as closing:
        with pytest.raises(ValueError, match="no model 'critic'"):
            GatewayGRPO(gw_url, _solve_then_verify, weights_dir=tmp_path,
                        admin_token=ADMIN_TOKEN, policy="critic")
        gw = GatewayGRPO(gw_url, _solve_then_verify, weights_dir=tmp_path,
                         admin_token=ADMIN_TOKEN, run_id="duo", policy="verifier")
        closing.callback(gw.close)
        rows = gw.rollout_func(["2+2", "2+2"], _trainer(2))
        for tid, mask, ids in zip(rows["trajectory_id"], rows["env_mask"],
                                  rows["completion_ids"], strict=True):
            calls = httpx.get(f"{gw_url}/trajectories/{tid}", timeout=10,
                              headers=admin).json()["calls"]
            (verify,) = [c for c in calls if c["model"] == "verifier"]
            assert [t for t, m in zip(ids, mask, strict=True) if m] == verify["completion_ids"]
        with pytest.raises(ValueError, match="LoRA family"):
            gw.push(_Model())
        push = gw.push(_Lora())
        assert push.version == "1" == gw.version
        status = httpx.get(f"{gw_url}/status", timeout=10, headers=admin).json()
        assert status["models"]["verifier"]["adapter"] == "verifier@lora-1"
        assert status["weight_version"] == "0"  # the solver's (the base's) is untouched
