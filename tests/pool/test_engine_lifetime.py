"""Engines never outlive their gateway unseen, and ``serve`` says when its pool is ready.

Real ``rollout-gateway serve --pool`` processes with a managed pool of the local vLLM
launcher, whose engine is a small stand-in (``standin_engine.py``: an HTTP server with
an "engine core" child started by ``multiprocessing``): the launcher's code path, guard
and records are the ones real vLLM runs under (``tests/vllm/test_engine_lifetime_vllm.py``
does the same with vLLM). Processes of an engine are found by its tag, as the guard and
the reaper find them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.engine_guard import tagged
from tests.reliability.procs import Child
from tests.servers import free_port

STANDIN = Path(__file__).with_name("standin_engine.py")
ADMIN = {"Authorization": "Bearer tok"}
Start = Callable[..., Child]


def pool_spec(tmp_path: Path, python: str, *, env: dict[str, str] | None = None,
              count: int = 2, max_restarts: int = 3) -> Path:
    """A CPU pool of ``count`` TP1 engines run by ``python`` (the stand-in or vLLM)."""
    spec = {
        "model": "tiny", "inventory": {"gpus": count},
        "launcher": {"kind": "vllm", "python": python, "device": "cpu",
                     "start_timeout_s": 300, "env": env or {},
                     "log_dir": str(tmp_path / "logs"), "state_dir": str(tmp_path / "state")},
        "layout": [{"tp": 1, "count": count}], "check_interval_s": 0.2,
        "restart": {"max_restarts": max_restarts, "backoff_s": 0.2},
    }
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(spec))
    return path


def standin_python(tmp_path: Path) -> str:
    """An executable the launcher runs as its "python": the stand-in engine."""
    path = tmp_path / "standin-python"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} "$@"\n')
    path.chmod(0o755)
    return str(path)


def records(state_dir: Path) -> dict[str, dict[str, Any]]:
    """The engine records in ``state_dir`` by tag."""
    if not state_dir.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in state_dir.glob("*.json")}


def processes(tags: Iterator[str] | list[str]) -> list[int]:
    return [pid for tag in tags for pid in tagged(tag)]


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Start]:
    """``start_gateway(spec, name, *args)``: a ``serve`` child (SIGKILLed at the end)."""
    children: list[Child] = []
    db = f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}"

    def start(spec: Path, name: str, *args: str) -> Child:
        port = free_port()
        child = Child(["serve", "--port", str(port), "--pool", str(spec), "--database-url", db,
                       *args], port, log=tmp_path / f"{name}.log",
                      env={"ROLLOUT_GATEWAY_SERVER__SHUTDOWN_DELAY_S": "0",
                           "ROLLOUT_GATEWAY_ADMIN_TOKEN": "tok"})
        children.append(child)
        return child

    yield start
    for child in children:
        child.stop()


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
    wait_for(lambda: not processes(tags), 20, f"engines gone: {processes(tags)}")
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
