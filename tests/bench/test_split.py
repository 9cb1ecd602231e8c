"""``bench split``: one scheduler against the same batch split by group hash, per seed."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from rollout_gateway.cli import app


def test_split_runs_each_seed_on_both_sides_and_writes_them(tmp_path: Path) -> None:
    out = tmp_path / "split.json"
    r = CliRunner().invoke(app, ["bench", "split", "--workload", "math-code", "--seeds", "2",
                                 "--gpus", "8", "--per-gpu", "2", "--jobs", "1",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())["results"]["math-code"]
    assert res["seeds"] == 2 and len(res["sharded_s"]) == len(res["one_scheduler_s"]) == 2
    for split, one, sharded in zip(res["per_shard"], res["one_scheduler_s"],
                                   res["sharded_s"], strict=True):
        assert len(split) == 2 and sum(split) == 32  # 2 groups of 16, both sides
        assert one > 0 and sharded > 0
    lo, hi = res["ci95"]
    assert lo <= res["ratio_geomean"] <= hi
    assert "2 shards of 8 GPUs" in r.output
    rb = res["rebalanced"]  # the third side, on by default: paired with the others
    assert len(rb["rebalanced_s"]) == len(rb["moves"]) == 2 and all(
        t > 0 for t in rb["rebalanced_s"])
    assert rb["ci95"][0] <= rb["ratio_geomean"] <= rb["ci95"][1]
    assert "with the rebalancer" in r.output
    r = CliRunner().invoke(app, ["bench", "split", "--workload", "math-code", "--seeds", "1",
                                 "--gpus", "8", "--per-gpu", "1", "--jobs", "1",
                                 "--rebalance-s", "0", "--json", str(out)])
    assert r.exit_code == 0 and "rebalanced" not in json.loads(out.read_text())["results"][
        "math-code"]
    bad = CliRunner().invoke(app, ["bench", "split", "--shards", "1"])
    assert bad.exit_code != 0
