"""bench vllm-cpu end to end at its smallest size (real vLLM engines on CPU).

Marked ``slow`` (``pytest -m slow``), out of ``make test``: two to three minutes of engine
starts for a benchmark command, where CI's time limit is near."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_vllm_cpu_runs_two_policies(vllm_python: str, tmp_path: Path):
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "bench", "vllm-cpu", "--prompts", "1",
         "--group-size", "3", "--out", str(tmp_path), "--json", str(tmp_path / "r.json")],
        cwd=ROOT, text=True, capture_output=True, timeout=420, check=False,
        env={**os.environ, "ROLLOUT_GATEWAY_VLLM_PYTHON": vllm_python})
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    for name in ("slime", "progressive"):
        r = doc["results"][name]
        assert r["failed_trajectories"] == 0
        assert r["makespan_s"] > 0 and r["throughput_tok_s"] > 0
        assert 0 <= r["prefix_cache_hit_rate"] <= 1
