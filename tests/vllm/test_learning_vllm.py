"""A model learns through the gateway, and a defect in what reaches the trainer fails.

The proof that the samples are right is a model that improves by training on them. Here,
on a real vLLM CPU engine behind the gateway:

1. ``examples/lookup_task.py warm-start`` makes the policy: the tiny model's architecture
   and tokenizer, trained briefly on generated demonstrations to call the ``lookup`` tool
   and copy its answer, but to call it only rarely (it mostly guesses the code: one
   chance in ten).
2. ``examples/trl_grpo.py --task lookup`` runs TRL's ``GRPOTrainer`` through the gateway:
   plain OpenAI-SDK agent code per trajectory (two calls when it looks the code up), the
   recorded samples fetched and handed to TRL, the new weights pushed to the engine after
   every step. Success (reward 1: the right code) must rise from its first steps to its
   last, by at least twice and significantly (one-sided two-proportion z-test over the
   trajectories of the first and last ``WINDOW`` steps, z >= ``Z``).
3. The same run with the loss mask moved one token late (``--defect mask-shift``: the
   first token of every model turn, the choice to call the tool among them, cut from the
   loss) must not pass that check.
4. TRL's ``AsyncGRPOTrainer`` (``examples/trl_async_grpo.py``: rollouts go on while it
   trains, the gateway's staleness bound 1) must pass it too, with no sample TRL had to
   drop as stale and TRL's own importance ratio at its first step (the trainer's tree
   attention on CPU against the engine's recorded logprobs, same weights) at 1. This one
   is marked ``slow`` (``pytest -m slow``), out of ``make test``: CI's time limit.

The runs of a test share the warm start and the engine (each run's first push loads its
weights). A clean run that does not pass gets another try (``ATTEMPTS``); the defect gets one.
The 3-seed curve is a benchmark (``bench learn``, BENCHMARKS.md); this is one seed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import REPO_ROOT, own_engine_gateway

pytestmark = pytest.mark.vllm
STEPS = 24
GROUPS = 4
GROUP_SIZE = 8
LR = "2e-4"
WINDOW = 3  # steps at each end compared
Z = 3.0
#: tries a clean run gets (seeds 0, 1, 2): GRPO on one seed now and then goes the wrong way
#: (its first steps reward the guess and the model stops calling the tool). Measured here:
#: GRPOTrainer at seed 0 learned in 1 of 3 runs (0.14 -> 0.61; 0.09 -> 0.06 and 0.11 -> 0.10
#: in the others), at seed 1 in 1 of 1 (0.23 -> 0.68); AsyncGRPOTrainer at seed 0 in 3 of 3
#: (z 7.0 and 3.4 here, 0.24 -> 0.71 in the benchmark)
ATTEMPTS = 3


def rises(rewards: list[list[float]]) -> tuple[float, float, float]:
    """Success over the first and last ``WINDOW`` steps and the one-sided z statistic of
    the rise (pooled two-proportion test over their trajectories)."""
    first = [r for step in rewards[:WINDOW] for r in step]
    last = [r for step in rewards[-WINDOW:] for r in step]
    p0, p1 = sum(first) / len(first), sum(last) / len(last)
    pooled = (sum(first) + sum(last)) / (len(first) + len(last))
    se = math.sqrt(pooled * (1 - pooled) * (1 / len(first) + 1 / len(last)))
    return p0, p1, (p1 - p0) / se if se else 0.0


def learned(p0: float, p1: float, z: float) -> bool:
    return z >= Z and p1 >= 2 * p0


def test_rises_measures_what_it_should() -> None:
    assert learned(*rises([[0.0] * 30 + [1.0] * 2] * 3 + [[1.0] * 16 + [0.0] * 16] * 3))
    assert not learned(*rises([[1.0] * 8 + [0.0] * 24] * 6))  # flat
    assert not learned(*rises([[1.0] * 16 + [0.0] * 16] * 3 + [[1.0] * 4 + [0.0] * 28] * 3))


async def _run(*args: str, log: Path, timeout_s: float) -> None:
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, cwd=REPO_ROOT, stdout=err, stderr=err,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
                 "ROLLOUT_GATEWAY_ADMIN_TOKEN": "tok"})
        try:
            rc = await asyncio.wait_for(proc.wait(), timeout_s)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert rc == 0, log.read_text(errors="replace")[-4000:]


async def _grpo(gateway: str, policy: Path, work: Path, defect: str,
                attempt: int = 0) -> dict[str, Any]:
    name = f"{defect}-{attempt}"
    out = work / f"{name}.json"
    await _run(str(REPO_ROOT / "examples/trl_grpo.py"), "--gateway", gateway,
               "--model-path", str(policy), "--work-dir", str(work / name),
               "--task", "lookup", "--steps", str(STEPS), "--groups", str(GROUPS),
               "--group-size", str(GROUP_SIZE), "--lr", LR, "--seed", str(attempt),
               "--defect", defect, "--json", str(out),
               log=work / f"{name}.log", timeout_s=600)
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


async def _trl_async(gateway: str, policy: Path, work: Path,
                     attempt: int = 0) -> dict[str, Any]:
    name = f"trl-async-{attempt}"
    out = work / f"{name}.json"
    await _run(str(REPO_ROOT / "examples/trl_async_grpo.py"), "--gateway", gateway,
               "--model-path", str(policy), "--work-dir", str(work / name),
               "--steps", str(STEPS), "--groups", str(GROUPS), "--group-size",
               str(GROUP_SIZE), "--lr", LR, "--seed", str(attempt), "--max-staleness",
               "1", "--json", str(out), log=work / f"{name}.log", timeout_s=600)
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def _judge(run: str, summary: dict[str, Any]) -> bool:
    """Check one run's plumbing (asserts) and say whether it learned."""
    rewards = [step["rewards"] for step in summary["steps"]]
    assert len(rewards) == STEPS and all(len(r) == GROUPS * GROUP_SIZE for r in rewards)
    assert all(r in (0.0, 1.0) for step in rewards for r in step)
    if run == "trl-async":
        # within the gateway's bound when taken, nothing left for TRL to drop, and TRL's
        # ratio at its first step (the engine served the same weights) is 1
        assert all(s["max_staleness"] <= 1 for s in summary["steps"])
        assert summary["steps"][-1]["dropped_by_trl"] == 0
        first = summary["steps"][0]["trl"]
        assert abs(first["ratio"] - 1) < 0.01 and first["kl"] < 1e-3, first
        assert [p["version"] for p in summary["pushes"]] == list(range(1, STEPS + 2))
    else:
        # every step trained on its own version's tokens (what the engines served)
        assert all(s["max_staleness"] == 0 and s["off_version_tokens"] == 0
                   for s in summary["steps"])
    p0, p1, z = rises(rewards)
    curve = " ".join(f"{sum(r) / len(r):.2f}" for r in rewards)
    step_s = sum(s.get("rollout_s", s.get("wait_s", 0)) + s.get("fetch_s", 0)
                 + s["train_s"] for s in summary["steps"])
    print(f"\n{run}: success {p0:.2f} -> {p1:.2f} (z {z:.1f}); curve {curve}; "
          f"{step_s / STEPS:.1f} s a step; run {summary['total_s']} s")
    return learned(p0, p1, z)


async def _warm_start(tiny_model_dir: Path, tmp_path: Path) -> Path:
    policy = tmp_path / "policy"
    await _run(str(REPO_ROOT / "examples/lookup_task.py"), "warm-start",
               "--base", str(tiny_model_dir), "--out", str(policy),
               log=tmp_path / "warm.log", timeout_s=600)
    return policy


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.timeout(2400)
async def test_a_model_learns_through_the_gateway_and_a_shifted_mask_does_not(
        vllm_python: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    policy = await _warm_start(tiny_model_dir, tmp_path)
    warm_s = time.monotonic() - t0
    verdicts: dict[str, bool] = {}
    async with own_engine_gateway(vllm_python, tiny_model_dir, tmp_path, "learn") as url:
        for attempt in range(ATTEMPTS):
            verdicts["none"] = _judge("none", await _grpo(url, policy, tmp_path, "none",
                                                          attempt))
            if verdicts["none"]:
                break
        verdicts["mask-shift"] = _judge("mask-shift", await _grpo(url, policy, tmp_path,
                                                                  "mask-shift"))
    print(f"warm start {warm_s:.0f} s; whole test {time.monotonic() - t0:.0f} s")
    assert verdicts == {"none": True, "mask-shift": False}, verdicts


@pytest.mark.slow  # 4-5 minutes a run; the synchronous trainer above is the default run's
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.timeout(2400)
async def test_trls_async_trainer_learns_through_the_gateway(
        vllm_python: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = await _warm_start(tiny_model_dir, tmp_path)
    learned_once = False
    async with own_engine_gateway(vllm_python, tiny_model_dir, tmp_path, "learn") as url:
        for attempt in range(ATTEMPTS):
            learned_once = _judge("trl-async", await _trl_async(url, policy, tmp_path,
                                                                 attempt))
            if learned_once:
                break
    assert learned_once
