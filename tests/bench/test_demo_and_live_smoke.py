"""The main job and the live benchmark run end to end at tiny sizes (so they cannot rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_gateway", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, check=False)


def test_demo_runs_a_batch_and_prints_the_summary():
    out = _cli("demo", "--prompts", "2", "--group-size", "2", "--instances", "2",
               "--speed", "40", "--port", "0")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "4 (0 failed)" in text
    assert "throughput" in text and "makespan" in text
    assert "status page: http://127.0.0.1:" in text
    assert "mismatches: 0" in text


def test_bench_live_writes_its_report(tmp_path: Path):
    out = _cli("bench", "live", "--prompts", "1", "--group-size", "3", "--gpus", "2",
               "--speed", "40", "--policy", "slime", "--policy", "progressive",
               "--out", str(tmp_path), "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    for name in ("slime", "progressive"):
        r = doc["results"][name]
        for key in ("makespan_s", "throughput_tok_s", "p50_trajectory_s", "p99_trajectory_s",
                    "lower_bound_makespan_s", "migrations", "reconfigurations",
                    "queue_per_turn_mean_s", "prefix_cache_hit_rate", "gpu_idle_fraction",
                    "sim_makespan_s", "live_vs_sim_diff"):
            assert key in r, key
        assert r["failed_trajectories"] == 0
        assert r["makespan_s"] >= r["lower_bound_makespan_s"] * 0.95
        assert 0 <= r["gpu_idle_fraction"] <= 1
    assert (tmp_path / "live.md").exists() and (tmp_path / "throughput.png").stat().st_size > 0
