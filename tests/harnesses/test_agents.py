"""An agent harness installed from PyPI (mini-swe-agent), run as its CLI the way users
run it, leaves an exact trace (the SDK harnesses are in test_agent_sdks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from tests.harnesses.trace import assert_exact_trace

MODEL = "qwen3-14b"


def _tid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_mini_swe_agent_subprocess(sim_pool, gateway_at, sqlite_url, tmp_path: Path):
    """mini-swe-agent from PyPI, run as its CLI: every step it takes is a call traced with
    exact tokens (the simulated model's commands are nonsense words; the agent runs them
    in a scratch directory, they fail, and it goes on until its step limit)."""
    traj = _tid("mini")
    mini = Path(sys.executable).with_name("mini")
    with gateway_at(sqlite_url, sim_pool) as gw:
        env = {**os.environ, "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
               "MSWEA_SILENT_STARTUP": "1", "HOME": str(tmp_path)}
        proc = subprocess.run(
            [str(mini), "-m", f"openai/{MODEL}", "-t", "make tests/test_x.py pass", "-y",
             "--exit-immediately", "-o", str(tmp_path / "traj.json"),
             "-c", "mini.yaml", "-c", "agent.step_limit=3", "-c", "agent.cost_limit=0",
             "-c", f"model.model_kwargs.api_base={gw}/t/{traj}/v1",
             "-c", "model.model_kwargs.api_key=EMPTY",
             "-c", "model.model_kwargs.max_tokens=300"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
            stdin=subprocess.DEVNULL)
        calls = httpx.get(f"{gw}/trajectories/{traj}").json().get("calls", [])
        assert len(calls) >= 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert_exact_trace(gw, traj)
