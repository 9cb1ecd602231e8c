"""A gateway process killed mid-batch and started again resumes every trajectory.

Two runs drive the same multi-turn trajectories, turn by turn, through a fresh simulated
vLLM server with the same seed (so the same requests get the same tokens): one gateway
process serves the first run from start to end; in the second the gateway is SIGKILLed
after turn 2 (once its trace writer has flushed) and a new process takes over on the same
database. The samples must be identical: ``seq`` continues instead of restarting at 0, and
the first call after the restart is stored as a delta of the restored sequence, not whole.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.procs import Child, sim_backend
from tests.servers import free_port

TRAJECTORIES, TURNS, RESTART_AT = 3, 4, 2


def _gateway(backend: str, db: str, tmp_path: Path, name: str) -> Child:
    port = free_port()
    env = {"ROLLOUT_GATEWAY_POLICY": "slime", "ROLLOUT_GATEWAY_DISPATCH__MIGRATE": "false",
           "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH": str(tmp_path / f"{name}.spool"),
           "ROLLOUT_GATEWAY_TRACES__FLUSH_INTERVAL_S": "0.05"}
    child = Child(["serve", "--port", str(port), "--backend", backend, "--database-url", db],
                  port, env=env, log=tmp_path / f"{name}.log")
    child.wait_ready()
    return child


def _flushed(gw: Child, calls: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        writer = httpx.get(f"{gw.url}/status", timeout=5).json()["trace_writer"]
        if writer["written"] >= calls and writer["queue_depth"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"trace writer did not flush {calls} calls: {writer}")


def _run(db: str, tmp_path: Path, prefix: str, *, restart: bool) -> dict[str, Any]:
    backend = sim_backend(speed=50, seed=7)  # fresh engine: same seed, same tokens
    gw = _gateway(backend.url, db, tmp_path, f"{prefix}0")
    ids = [f"{prefix}-{i}" for i in range(TRAJECTORIES)]
    history: dict[str, list[dict[str, str]]] = {
        t: [{"role": "user", "content": f"task number {i}: fix the failing test"}]
        for i, t in enumerate(ids)}
    try:
        for turn in range(TURNS):
            if restart and turn == RESTART_AT:
                _flushed(gw, TRAJECTORIES * turn)
                gw.stop()  # SIGKILL: nothing in memory survives
                gw = _gateway(backend.url, db, tmp_path, f"{prefix}1")
            for tid in ids:
                r = httpx.post(f"{gw.url}/t/{tid}/v1/chat/completions", timeout=30, json={
                    "model": "qwen3-14b", "messages": history[tid], "max_tokens": 12})
                assert r.status_code == 200, r.text
                history[tid] += [r.json()["choices"][0]["message"],
                                 {"role": "user", "content": f"tool output {turn}"}]
        out = {}
        for i, tid in enumerate(ids):
            assert httpx.post(f"{gw.url}/trajectories/{tid}/finish",
                              json={"reward": float(i)}).status_code == 200
            sample = httpx.get(f"{gw.url}/trajectories/{tid}/sample").json()
            calls = httpx.get(f"{gw.url}/trajectories/{tid}").json()["calls"]
            out[f"t{i}"] = (sample, calls)
        return out
    finally:
        gw.stop()
        backend.stop()


@pytest.mark.parametrize("which", ["sqlite", pytest.param("postgres",
                                                          marks=pytest.mark.postgres)])
def test_a_restarted_gateway_resumes_seq_deltas_and_samples(
    which: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if which == "sqlite":
        db = f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}"
        from gateway.store.db import upgrade
        upgrade(db)
    else:
        db = str(request.getfixturevalue("postgres_url"))
    straight = _run(db, tmp_path, "straight", restart=False)
    restarted = _run(db, tmp_path, "restarted", restart=True)
    for key, (sample, calls) in restarted.items():
        want, _ = straight[key]
        assert [c["seq"] for c in calls] == list(range(TURNS))
        after = calls[RESTART_AT]
        assert after["prompt_offset"] > 0 and after["mismatch_pos"] is None
        assert after["prompt_offset"] == calls[RESTART_AT - 1]["prompt_offset"] + len(
            calls[RESTART_AT - 1]["prompt_delta_ids"]) + len(
            calls[RESTART_AT - 1]["completion_ids"])
        assert sample["mismatches"] == []
        for field in ("token_ids", "loss_mask", "logprobs", "weight_versions", "reward",
                      "attempt"):
            assert sample[field] == want[field], field
        assert [(c["seq"], c["prompt_start"], c["completion_end"]) for c in sample["calls"]] \
            == [(c["seq"], c["prompt_start"], c["completion_end"]) for c in want["calls"]]
