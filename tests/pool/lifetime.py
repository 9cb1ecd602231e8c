"""Helpers for tests of engine lifetimes: ``serve --pool`` children over the local vLLM
launcher (a stand-in engine or real vLLM), the engines' records and their processes."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from backends.engine_guard import tagged
from tests.reliability.procs import Child
from tests.servers import free_port

STANDIN = Path(__file__).with_name("standin_engine.py")
ADMIN = {"Authorization": "Bearer tok"}
Start = Callable[..., Child]


def pool_spec(tmp_path: Path, python: str, *, env: dict[str, str] | None = None,
              count: int = 2, max_restarts: int = 3, base: dict[str, Any] | None = None) -> Path:
    """A CPU pool of ``count`` TP1 engines run by ``python`` (the stand-in or vLLM), over
    ``base`` (a spec whose launcher options are kept unless set here)."""
    base = base or {}
    launcher = {**base.get("launcher", {}), "kind": "vllm", "python": python, "device": "cpu",
                "log_dir": str(tmp_path / "logs"), "state_dir": str(tmp_path / "state")}
    launcher["env"] = {**launcher.get("env", {}), **(env or {})}
    launcher.setdefault("start_timeout_s", 300)
    spec = {
        **base, "model": base.get("model", "tiny"), "inventory": {"gpus": count},
        "launcher": launcher, "layout": [{"tp": 1, "count": count}], "check_interval_s": 0.2,
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


def processes(tags: Iterable[str]) -> list[int]:
    return [pid for tag in tags for pid in tagged(tag)]


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``check`` until true; the seconds it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


@contextmanager
def gateways(tmp_path: Path) -> Iterator[Start]:
    """``start(spec, name, *args)``: a ``serve`` child; all are SIGKILLed at the end."""
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

    try:
        yield start
    finally:
        for child in children:
            child.stop()
