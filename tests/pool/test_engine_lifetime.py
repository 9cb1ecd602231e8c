"""Engines never outlive their gateway unseen, and ``serve`` says when its pool is ready.

Real ``rollout-gateway serve --pool`` processes with a managed pool of the local vLLM
launcher, whose engine is a small stand-in (``standin_engine.py``: an HTTP server with
an "engine core" child started by ``multiprocessing``): the launcher's code path, guard
and records are the ones real vLLM runs under (``tests/vllm/test_engine_lifetime_vllm.py``
does the same with vLLM). Processes of an engine are found by its tag, as the guard and
the reaper find them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.engine_guard import tagged
from tests.pool.lifetime import (
    ADMIN,
    Start,
    gateways,
    pool_spec,
    processes,
    records,
    standin_python,
    wait_for,
)


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Start]:
    with gateways(tmp_path) as start:
        yield start


def test_a_sigkilled_gateway_takes_its_engines_with_it(
        tmp_path: Path, start_gateway: Start) -> None:
    state = tmp_path / "state"
    gw = start_gateway(pool_spec(tmp_path, standin_python(tmp_path)), "gw")
    gw.wait_ready("/ready", timeout_s=60)
    tags = list(records(state))
    assert len(tags) == 2
    for tag in tags:  # guard, API server, engine core, multiprocessing's resource tracker
        assert len(tagged(tag)) >= 3, (tag, tagged(tag))

    gw.proc.send_signal(signal.SIGKILL)  # as an OOM kill or a crash would
    gw.proc.wait(10)
    took = wait_for(lambda: not processes(tags), 20, f"engines gone: {processes(tags)}")
    print(f"every process of both engines gone {took:.2f} s after the gateway's kill -9")
    wait_for(lambda: not records(state), 5, "the guards removed their records")
    for log in (tmp_path / "logs").iterdir():
        assert "the gateway is gone" in log.read_text(), log


def test_a_restarted_gateway_stops_what_a_dead_one_left_and_serves_with_its_own(
        tmp_path: Path, start_gateway: Start) -> None:
    state = tmp_path / "state"
    spec = pool_spec(tmp_path, standin_python(tmp_path))
    first = start_gateway(spec, "first")
    first.wait_ready("/ready", timeout_s=60)
    old = records(state)
    assert len(old) == 2
    # The gateway and the engines' guards die together (kill -9 of all of them): the API
    # servers get SIGTERM from the kernel, but their engine cores live on, orphaned.
    for pid in [first.proc.pid, *(r["guard"]["pid"] for r in old.values())]:
        os.kill(pid, signal.SIGKILL)
    first.proc.wait(10)
    time.sleep(1.0)
    orphans = processes(list(old))
    assert orphans, "nothing was left behind: the scenario did not happen"

    second = start_gateway(spec, "second")
    second.wait_ready("/ready", timeout_s=60)
    assert not processes(list(old)), "the restarted gateway left the old engines running"
    assert "left running by a gateway that is gone" in second.output()
    new = records(state)
    assert len(new) == 2 and not set(new) & set(old)
    pool = httpx.get(f"{second.url}/admin/pool", headers=ADMIN).json()
    assert [i["state"] for i in pool["instances"]] == ["ready", "ready"]
    assert sorted(int(i["url"].rsplit(":", 1)[1]) for i in pool["instances"]) == sorted(
        r["port"] for r in new.values())
    r = httpx.post(f"{second.url}/t/after-restart/v1/chat/completions", timeout=30,
                   headers=ADMIN, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text

    second.signal(signal.SIGTERM)  # a clean stop stops the engines too
    assert second.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    assert not processes(list(new)) and not records(state)


def test_ready_is_503_until_the_engines_are_up_while_health_stays_200(
        tmp_path: Path, start_gateway: Start) -> None:
    spec = pool_spec(tmp_path, standin_python(tmp_path), env={"STANDIN_DELAY_S": "3"})
    gw = start_gateway(spec, "gw")
    gw.wait_ready("/health", timeout_s=30)
    health = httpx.get(f"{gw.url}/health").json()
    assert health["status"] == "ok" and health["ready"]["ready"] is False
    early = httpx.get(f"{gw.url}/ready")
    assert early.status_code == 503
    assert early.json()["reason"].startswith("starting the pool (job 1): 0 of 2 engines up")
    gw.wait_ready("/ready", timeout_s=60)
    body = httpx.get(f"{gw.url}/ready").json()
    assert body["ready"] is True and body["engines_ready"] == body["engines_planned"] == 2
    assert httpx.get(f"{gw.url}/health").json()["ready"]["ready"] is True
    wait_for(lambda: "pool ready: 2 of 2 engines up" in gw.output(), 5, "the ready line")


def test_wait_ready_opens_the_port_only_once_the_pool_is_up(
        tmp_path: Path, start_gateway: Start) -> None:
    spec = pool_spec(tmp_path, standin_python(tmp_path), env={"STANDIN_DELAY_S": "2"})
    gw = start_gateway(spec, "gw", "--wait-ready")
    gw.wait_ready("/health", timeout_s=60)
    ready = httpx.get(f"{gw.url}/ready")  # the first answer the port ever gives
    assert ready.status_code == 200 and ready.json()["engines_ready"] == 2
    out = gw.output()
    assert out.index("pool ready: 2 of 2 engines up") < out.index("Uvicorn running on")


def test_wait_ready_exits_when_no_engine_comes_up(tmp_path: Path, start_gateway: Start) -> None:
    spec = pool_spec(tmp_path, standin_python(tmp_path), env={"STANDIN_EXIT": "5"}, count=1,
                     max_restarts=0)
    gw = start_gateway(spec, "gw", "--wait-ready")
    assert gw.proc.wait(60) == 3, gw.output()
    assert "no engine of the initial layout came up" in gw.output()
    assert not records(tmp_path / "state")
