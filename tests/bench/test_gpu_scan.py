"""The committed H100 decode scan, read by ``bench gpu-scan``: the cost model's premise
checked against a measurement (docs/tp-efficiency.md, "Measured on an H100")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bench.reports.gpu_scan import (
    FUSED,
    SCAN,
    gpu_scan,
    load_scan,
    profile_rows,
    reference_points,
)
from rollout_gateway.cli import app

REPO = Path(__file__).resolve().parents[2]


def scans() -> tuple[dict, dict]:
    return load_scan(REPO / SCAN), load_scan(REPO / FUSED)


def test_calibrated_profiles_match_the_measured_gpu_step() -> None:
    """Every H100 profile's step (all-reduce included) is within 20% of the measured GPU
    step plus the same all-reduce term, at 1, 64 and 256 sequences, TP1 to TP8."""
    rows = profile_rows(scans()[0], "H100")
    assert {(r["model"], r["tp"], r["batch"]) for r in rows} >= {
        (m, tp, b) for m in ("qwen3-8b", "qwen3-14b", "qwen3-32b", "llama3.1-8b")
        for tp in (1, 2, 4, 8) for b in (1, 64, 256)}
    off = [r for r in rows if not 0.8 <= r["sim_over_measured"] <= 1.2]
    assert not off, off


def test_ratio_falls_with_cpu_and_all_reduce_and_inverts() -> None:
    points = {p.model: p for p in reference_points(*scans())}
    assert set(points) == {"qwen3-8b", "qwen3-14b", "qwen3-32b", "llama3.1-8b"}
    p = points["qwen3-14b"]
    assert p.fused[8] < p.plain[8] and p.fused[1] < p.plain[1]  # fusion only removes work
    gpu_bound = p.ratio(gpu="H100", fused=True, ar_scale=1.0, cpu_ms=0.0)
    assert gpu_bound > 3.0  # the GPU alone scales TP8 past every published measurement
    assert p.ratio(gpu="H100", fused=True, ar_scale=3.0, cpu_ms=0.0) < gpu_bound
    assert p.ratio(gpu="H100", fused=True, ar_scale=1.0, cpu_ms=10.0) < gpu_bound
    for target in (1.15, 1.6, 2.2):
        c = p.cpu_for(target, gpu="H100", fused=True, ar_scale=1.0)
        assert p.ratio(gpu="H100", fused=True, ar_scale=1.0, cpu_ms=c) == pytest.approx(target)
    # the band's low end takes an engine that leaves ~0.1 s of CPU per step unhidden
    assert p.cpu_for(1.15, gpu="H100", fused=True, ar_scale=1.0) > 50


def test_cli_prints_both_tables() -> None:
    out = CliRunner().invoke(app, ["bench", "gpu-scan"], env={"COLUMNS": "250"})
    assert out.exit_code == 0, out.output
    assert "calibrated profile vs measured" in out.output
    assert "qwen3-32b" in out.output and "c for low" in out.output


def test_a_file_that_is_not_a_scan_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(typer.BadParameter, match="not a decode scan"):
        gpu_scan(scan=bad, fused=None, gpu="H100")
    with pytest.raises(typer.BadParameter, match="cannot read"):
        gpu_scan(scan=tmp_path / "missing.json", fused=None, gpu="H100")
