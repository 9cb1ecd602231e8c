"""Fixtures for fault injection: a gateway whose runtime the test can inspect, and
simulated vLLM servers in child processes that a test may kill."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from gateway.app import create_app
from gateway.config import Settings
from gateway.runtime import Runtime
from tests.reliability.procs import Child, sim_backend
from tests.scripted_upstream import Script, Seen, make_upstream
from tests.servers import LoopThread, app_in_thread

MODEL = "qwen3-14b"
Gateway = Callable[[Settings], AbstractContextManager[tuple[str, Runtime]]]


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture
def gateway(loop_thread: LoopThread) -> Gateway:
    """``with gateway(settings) as (url, rt)``: the app on a real socket; ``rt`` is its
    live runtime (read it, do not drive it)."""

    @contextlib.contextmanager
    def start(settings: Settings) -> Iterator[tuple[str, Runtime]]:
        app = create_app(settings)
        with app_in_thread(loop_thread, lambda: app) as url:
            yield url, app.state.runtime

    return start


@pytest.fixture
def sim_children() -> Iterator[Callable[..., Child]]:
    """Start simulated vLLM servers as child processes; all are killed at the end."""
    started: list[Child] = []

    def start(**kw: object) -> Child:
        child = sim_backend(**kw)  # type: ignore[arg-type]
        started.append(child)
        return child

    yield start
    for child in started:
        child.stop()


@pytest.fixture
def scripted(loop_thread: LoopThread) -> Iterator[Callable[[Script], tuple[str, Seen]]]:
    """Scriptable vLLM-shaped upstreams (hang, 5xx, slow) on real sockets."""
    stack = contextlib.ExitStack()

    def start(script: Script) -> tuple[str, Seen]:
        seen = Seen()
        url = stack.enter_context(app_in_thread(loop_thread, lambda: make_upstream(script, seen)))
        return url, seen

    with stack:
        yield start
