"""CI smoke of ``rollout-gateway bench overhead`` at tiny sizes (real processes, Postgres).

Direct + gateway always. The LiteLLM target runs only where its throwaway virtualenv
already exists (``~/.cache/rollout-gateway/litellm-venv``; creating it takes over a
minute of downloads), or when ``ROLLOUT_GATEWAY_BENCH_LITELLM=1`` asks for it anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.litellm_env import DEFAULT_VENV

pytestmark = [pytest.mark.postgres, pytest.mark.slow]  # slow: CI time (README)


def _run(out: Path, rate: int, *targets: str) -> dict:
    cmd = [sys.executable, "-m", "gateway", "bench", "overhead", "--rate", str(rate),
           "--duration", "1.5", "--search-step", "1", "--search-steps", "2",
           "--out", str(out)]
    for t in targets:
        cmd += ["--target", t]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert (out / "overhead.md").exists() and (out / "overhead-latency.png").exists()
    return json.loads((out / "overhead.json").read_text())


def _check_target(doc: dict, name: str, rate: int) -> None:
    res = doc["results"][name]
    step = res["fixed"][str(rate)]
    assert step["errors"] == 0 and step["ok"] > 0
    assert 0 < step["all"]["p50_ms"] <= step["all"]["p99_ms"] < 10_000
    assert res["max_rate"]["saturation"]["achieved_rps"] > 0
    assert doc["summary"]["max_rate_rps"][name] >= 0


@pytest.mark.timeout(240)
def test_overhead_direct_plain_and_gateway(tmp_path: Path):
    doc = _run(tmp_path, 40, "direct", "plain", "gateway")
    for name in ("direct", "plain", "gateway"):
        _check_target(doc, name, 40)
    assert doc["summary"]["gateway_over_plain_ms"]["40"]["p50_ms"] is not None
    added = doc["summary"]["added_latency_ms"]["gateway"]["40"]
    assert added["all"]["p50_ms"] is not None
    assert doc["info"]["gateway"]["calls_recorded"] > 0  # traces were on, into Postgres
    assert set(doc["summary"]["targets"]) == {"p50_added_at_500_le_1ms",
                                              "p99_added_at_500_le_5ms",
                                              "max_rate_ge_3x_litellm"}


@pytest.mark.timeout(300)
@pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "litellm").exists()
                    and os.environ.get("ROLLOUT_GATEWAY_BENCH_LITELLM") != "1",
                    reason="LiteLLM venv absent (set ROLLOUT_GATEWAY_BENCH_LITELLM=1 to build)")
def test_overhead_litellm(tmp_path: Path):
    doc = _run(tmp_path, 5, "litellm")
    _check_target(doc, "litellm", 5)
    info = doc["info"]["litellm"]
    assert info["calls_logged"] > 0  # its request logging was on
    assert info["health_before"]["status"] == info["health_after"]["status"] == "healthy"
    assert info["server_log_errors"]["count"] == 0, info["server_log_errors"]
    assert doc["summary"]["litellm_per_core"]["saturation_rps_per_core"] > 0
