"""The GPU decode scan (bench/calibrate/decode_scan.py) runs as shipped, on the CPU with
its tiny stand-in model, in the vLLM environment's torch (the gateway's has none)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def test_tiny_scan_writes_every_point(vllm_python: str, tmp_path: Path) -> None:
    out = tmp_path / "scan.json"
    subprocess.run(
        [vllm_python, "bench/calibrate/decode_scan.py", "--tiny", "--out", str(out),
         "--tps", "1,2,8", "--batches", "1,8", "--ctx", "64", "--ctx-sweep", "128",
         "--ctx-batch", "2", "--prefill", "32", "--reps", "2", "--rounds", "2"],
        cwd=REPO, check=True, capture_output=True, timeout=240)
    doc = json.loads(out.read_text())
    assert doc["facts"]["device"] == "cpu"
    pts = doc["points"]
    # tiny has 4 heads: TP8 cannot split them and is left out, not faked
    assert {p["tp"] for p in pts} == {1, 2}
    for tp in (1, 2):
        mine = [p for p in pts if p["tp"] == tp]
        assert {(p["kind"], p.get("batch"), p["ctx"]) for p in mine} == {
            ("decode", 1, 64), ("decode", 8, 64), ("decode", 2, 128), ("prefill", None, 0)}
        for p in mine:
            assert p["step_ms"] == pytest.approx(p["layers_ms"] + p["head_ms"])
            assert p["layers_ms"] > 0 and p["head_ms"] > 0
