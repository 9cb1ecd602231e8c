"""Each script under examples/ runs unmodified against a gateway over a simulated pool.

The scripts are started as subprocesses, pointed at the gateway only through
``OPENAI_BASE_URL`` (or the client's base URL), and what they did must be in the store
as exact token traces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from gateway.store.export import SAMPLE_SCHEMA
from tests.client.conftest import MODEL, GatewayFactory, check_trace

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, base_url: str | None = None,
                timeout: float = 90, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``examples/<script>``; return the JSON summary it prints last."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "LANGSMITH_", "ANTHROPIC_"))}
    env["OPENAI_API_KEY"] = "EMPTY"
    if base_url is not None:
        env["OPENAI_BASE_URL"] = base_url
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    summary: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary


def _ids(prefix: str) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"{prefix}-{tag}", f"grp-{tag}"


def test_openai_tool_loop_records_every_turn_exactly(gateway: GatewayFactory,
                                                     sqlite_url: str) -> None:
    traj, group = _ids("tool-loop")
    with gateway(sqlite_url) as gw:
        # seed 0: the simulated model calls tools on turns 1-4 and answers on turn 5
        summary = run_example("openai_tool_loop.py", "--max-turns", "8", "--seed", "0",
                              base_url=f"{gw}/g/{group}/t/{traj}/v1")
        detail = check_trace(gw, traj, min_calls=summary["turns"])
    assert summary["model"] == MODEL
    assert len(detail["calls"]) == summary["turns"]
    assert detail["group_id"] == group
    assert summary["turns"] == 5 and summary["tool_calls"] == 4
    assert summary["answer"] is not None


def test_langgraph_agent_runs_unmodified(gateway: GatewayFactory, sqlite_url: str) -> None:
    """LangGraph + langchain-openai, configured only by OPENAI_BASE_URL; LangChain
    re-serializes tool-call arguments itself, and the trace must still be exact."""
    traj, group = _ids("langgraph")
    with gateway(sqlite_url) as gw:
        summary = run_example("langgraph_agent.py", "--max-turns", "8", "--seed", "0",
                              base_url=f"{gw}/g/{group}/t/{traj}/v1")
        detail = check_trace(gw, traj)
    assert summary["model"] == MODEL
    assert summary["stopped"] == "answer" and summary["answer"] is not None
    assert summary["turns"] == len(detail["calls"]) == 5 and summary["tool_calls"] == 4
    assert [c["finish_reason"] for c in detail["calls"]] == ["tool_calls"] * 4 + ["stop"]


def test_langgraph_agent_turn_limit_ends_the_episode(gateway: GatewayFactory,
                                                     sqlite_url: str) -> None:
    traj, _ = _ids("langgraph-limit")
    with gateway(sqlite_url) as gw:
        summary = run_example("langgraph_agent.py", "--max-turns", "2", "--seed", "0",
                              base_url=f"{gw}/t/{traj}/v1")
        detail = check_trace(gw, traj)
    assert summary["stopped"] == "max_turns" and summary["answer"] is None
    assert summary["turns"] == len(detail["calls"]) == 2


def test_grpo_driver_pulls_token_exact_batches(gateway: GatewayFactory, sqlite_url: str,
                                               tmp_path: Path) -> None:
    run = f"grpo-{uuid.uuid4().hex[:6]}"
    with gateway(sqlite_url) as gw:
        summary = run_example("grpo_driver.py", "--gateway", gw, "--run", run, "--steps", "2",
                              "--prompts", "2", "--group-size", "3", "--max-turns", "3",
                              "--timeout", "60", "--out", str(tmp_path))
        trajectories = [t for step in summary["steps"] for ids in step["groups"].values()
                        for t in ids]
        details = {t: check_trace(gw, t) for t in trajectories}
    assert len(trajectories) == 12 and [s["step"] for s in summary["steps"]] == [0, 1]
    for step in summary["steps"]:
        table = pq.read_table(step["file"])
        assert table.schema == SAMPLE_SCHEMA
        assert table.num_rows == step["rows"] == 6 and step["mismatches"] == 0
        for row in table.to_pylist():
            calls = details[row["trajectory_id"]]["calls"]
            assert row["group_id"] == details[row["trajectory_id"]]["group_id"]
            assert row["token_ids"] == [t for c in calls
                                        for t in c["prompt_delta_ids"] + c["completion_ids"]]
            assert sum(row["loss_mask"]) == sum(len(c["completion_ids"]) for c in calls)
            assert row["reward"] == details[row["trajectory_id"]]["reward"]
            assert json.loads(row["metadata"])["turns"] == row["num_calls"] == len(calls)
        advantages = step["advantages"]
        for ids in step["groups"].values():  # group-normalized: each sums to zero
            group = [advantages[t] for t in ids]
            assert len(group) == 3 and abs(sum(group)) < 1e-9
        assert set(step["lag_tokens"]) == {"0"}  # sync: on-policy
    # the weight sync between the steps: step 1 ran on the bumped version only
    assert summary["steps"][0]["weight_versions"] == ["0"]
    assert summary["steps"][1]["weight_versions"] == ["1"]


def test_grpo_driver_runs_asynchronous_steps_within_the_bound(
        gateway: GatewayFactory, sqlite_url: str, tmp_path: Path) -> None:
    run = f"grpo-{uuid.uuid4().hex[:6]}"
    with gateway(sqlite_url) as gw:
        summary = run_example("grpo_driver.py", "--gateway", gw, "--run", run, "--steps", "3",
                              "--prompts", "2", "--group-size", "3", "--max-turns", "3",
                              "--timeout", "60", "--out", str(tmp_path), "--mode", "async",
                              "--max-staleness", "1")
        for step in summary["steps"]:
            for ids in step["groups"].values():
                assert len(ids) == 3
                for t in ids:
                    check_trace(gw, t)
    assert summary["mode"] == "async" and len(summary["steps"]) == 3
    for step in summary["steps"]:
        assert step["rows"] == 6 and step["mismatches"] == 0
        assert max(int(k) for k in step["lag_tokens"]) <= 1


def test_agents_sdk_agent_runs_unmodified(gateway: GatewayFactory, sqlite_url: str) -> None:
    """The Agents SDK's default model speaks the Responses API through the gateway."""
    traj, group = _ids("agents-sdk")
    with gateway(sqlite_url) as gw:
        summary = run_example("agents_sdk_agent.py", base_url=f"{gw}/g/{group}/t/{traj}/v1")
        detail = check_trace(gw, traj, min_calls=2)
    assert summary["model"] == MODEL and summary["tool_calls"] >= 1 and summary["answer"]
    assert {c["endpoint"] for c in detail["calls"]} == {"responses"}
    assert detail["group_id"] == group


def test_anthropic_agent_runs_unmodified(gateway: GatewayFactory, sqlite_url: str) -> None:
    """A Messages-API tool loop configured only by ANTHROPIC_BASE_URL / _API_KEY."""
    traj, _ = _ids("anthropic")
    with gateway(sqlite_url) as gw:
        summary = run_example("anthropic_agent.py", "--model", MODEL, env_extra={
            "ANTHROPIC_BASE_URL": f"{gw}/t/{traj}", "ANTHROPIC_API_KEY": "sk-ant-none"})
        detail = check_trace(gw, traj, min_calls=3)
    assert summary["turns"] == 3 and summary["tool_calls"] >= 2 and summary["answer"]
    assert [c["finish_reason"] for c in detail["calls"]][:2] == ["tool_calls"] * 2
