"""A SIGKILLed gateway takes its real vLLM engines with it, and a restarted one serves
with exactly the engines it started (the stand-in variant: tests/pool/test_engine_lifetime.py).

The pool is ``examples/pool-vllm-cpu.yaml`` with this machine's paths and one engine
(two cores), so the example is exercised as written.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import yaml

from backends.engine_guard import group_members, tagged
from tests.pool.lifetime import ADMIN, gateways, pool_spec, processes, records, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # two vLLM starts
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pool-vllm-cpu.yaml"


def test_sigkill_stops_vllm_and_its_engine_core_and_a_restart_serves_its_own(
        vllm_python: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    base = yaml.safe_load(EXAMPLE.read_text())
    base["launcher"]["model_path"] = str(tiny_model_dir)
    spec = pool_spec(tmp_path, vllm_python, count=1, base=base)
    state = tmp_path / "state"
    with gateways(tmp_path) as start:
        first = start(spec, "first")
        first.wait_ready("/ready", timeout_s=300)
        old = records(state)
        (tag, record), = old.items()
        engine = tagged(tag)
        # the guard, vLLM's API server, its engine core (multiprocessing), ...
        assert len(engine) >= 3, engine
        assert set(engine) <= set(group_members(record["guard"]["pid"]))

        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        took = wait_for(lambda: not processes(old), 60, f"vLLM gone: {processes(old)}")
        print(f"vLLM (API server, engine core) gone {took:.2f} s after the gateway's kill -9")
        assert not records(state)

        second = start(spec, "second")
        second.wait_ready("/ready", timeout_s=300)
        new = records(state)
        assert len(new) == 1 and not set(new) & set(old)
        (instance,) = httpx.get(f"{second.url}/admin/pool", headers=ADMIN).json()["instances"]
        assert instance["state"] == "ready"
        assert int(instance["url"].rsplit(":", 1)[1]) == next(iter(new.values()))["port"]
        r = httpx.post(f"{second.url}/t/after-restart/v1/chat/completions", headers=ADMIN,
                       timeout=120, json={"model": "tiny", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        # pause and weight routes exist: the launcher set VLLM_SERVER_DEV_MODE=1
        assert httpx.get(f"{instance['url']}/is_paused").status_code == 200
