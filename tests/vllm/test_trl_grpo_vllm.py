"""TRL's GRPOTrainer drives the loop on a real vLLM engine (CPU build, tiny model).

``examples/trl_grpo.py`` runs as a user would run it, against a gateway over one real
vLLM TP1 engine of its own (its weights change): three steps of three groups of three
tool-agent trajectories, each step's samples fetched a group at a time, a real optimizer
step on the model, the new weights pushed to the engine through the weight-update job.
Checked from its JSON summary:

* every step's generated tokens carry the version pushed before that step (none of
  another version, no call across a push) and are 0 versions stale;
* the optimizer changed the weights (the parameter checksum differs after every step);
* the engine served the pushed weights: the greedy probe differs after every push, and
  the trainer's recomputed logprobs equal the engine's on every unconstrained call (the
  forced tool calls carry the engine's masked logprobs, so only they may differ);
* every step's training-inference mismatch covers every trained token, under the step's
  version, the forced tool calls apart (masked logprobs), raises no alarm, and reached
  the gateway's status;
* TRL logged the reward and the gateway's staleness for every step.

With ``lora`` the example trains a rank-8 LoRA adapter (peft) and every push is the
adapter alone, loaded by the engine beside the base model (``method: "lora"``, no pause):
the same checks hold, so the trainer's recomputed logprobs under its adapter equal what
the engine served on the adapter the gateway stamped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.vllm.conftest import REPO_ROOT, own_engine_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
STEPS = 3
GROUPS = 3
GROUP_SIZE = 3


async def _example(gateway: str, model_dir: Path, work: Path, lora: int) -> dict[str, Any]:
    out, log = work / "summary.json", work / "example.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(REPO_ROOT / "examples/trl_grpo.py"), "--gateway", gateway,
            "--model-path", str(model_dir), "--work-dir", str(work / "run"),
            "--steps", str(STEPS), "--groups", str(GROUPS), "--group-size", str(GROUP_SIZE),
            "--json", str(out), "--lora", str(lora), cwd=REPO_ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=err,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
                 "ROLLOUT_GATEWAY_ADMIN_TOKEN": "tok"})
        try:
            rc = await asyncio.wait_for(proc.wait(), 360)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    print("\n".join(line for line in text.splitlines() if line.startswith("step ")))
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lora", [0, 8], ids=["full-weights", "lora"])
async def test_trl_grpo_trains_through_the_gateway(
        vllm_python: str, tiny_model_dir: Path, tmp_path: Path, lora: int) -> None:
    t0 = time.monotonic()
    async with own_engine_gateway(vllm_python, tiny_model_dir, tmp_path, "trl",
                                  lora=bool(lora)) as url:
        started = time.monotonic() - t0
        summary = await _example(url, tiny_model_dir, tmp_path, lora)
        async with httpx.AsyncClient() as http:
            jobs = (await http.get(f"{url}/admin/jobs",
                                   headers={"authorization": "Bearer tok"})).json()["data"]
            board = (await http.get(f"{url}/status")).json()["training_mismatch"]

    methods = {j["request"].get("method") for j in jobs if j["kind"] == "weight-update"}
    assert methods == {"lora" if lora else "reload"}, methods
    steps, probes, sums = summary["steps"], summary["probes"], summary["checksums"]
    assert len(steps) == STEPS and len(probes) == len(sums) == STEPS + 1
    first = int(summary["initial_push"]["version"])
    for i, step in enumerate(steps):
        version = str(first + i)  # the push before the step
        assert step["version"] == version
        assert len(step["rewards"]) == GROUPS * GROUP_SIZE
        assert step["versions"] == {version: step["completion_tokens"]} and step[
            "completion_tokens"] > 0
        assert step["off_version_tokens"] == step["calls_across_update"] == 0
        assert step["max_staleness"] == 0 and step["dropped_tokens"] == 0
        assert step["push"]["version"] == str(first + i + 1)
        check = step["logprobs"]
        assert all(c.endswith("#0") for c in check["off_calls"]), check["off_calls"]
        assert check["matched"] >= GROUPS * GROUP_SIZE  # every answer call's tokens
        mm = step["mismatch"]  # every trained token compared, posted to the gateway
        # the forced tool calls apart (masked logprobs), every other token inside limits
        assert mm["overall"]["tokens"] + mm["constrained"]["tokens"] == step[
            "completion_tokens"], mm
        assert mm["alarms"] == [], mm
        assert list(mm["by_version"]) == [version] and mm["received_at"] is not None
    assert (board["reports"], board["alarms"]) == (STEPS, 0)
    assert [r["step"] for r in board["recent"]] == [s["step"] for s in reversed(steps)]
    assert summary["final_version"] == str(first + STEPS)
    assert all(a != b for a, b in itertools.pairwise(sums)), sums
    served = [(p["text"], p["logprob_sum"]) for p in probes]
    assert all(a != b for a, b in itertools.pairwise(served)), served
    logged = [row for row in summary["trl_log"] if "reward" in row]
    assert len(logged) == STEPS
    assert all("gateway/max_staleness" in row and "reward_std" in row for row in logged)
    print(f"engine ready in {started:.0f} s; example {summary['total_s']} s; rewards "
          f"{[round(r['reward'], 3) for r in logged]}; whole test "
          f"{time.monotonic() - t0:.0f} s")
