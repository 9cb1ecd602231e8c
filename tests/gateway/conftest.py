from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack

import pytest

from gateway.app import create_app
from gateway.config import Settings, TraceSettings, UpstreamSettings
from tests.gateway.slow_engines import two_slow_engines
from tests.scripted_upstream import Script, Seen, make_upstream
from tests.servers import LoopThread, app_in_thread, forget_updates_of, two_sim_servers

GatewayFactory = Callable[..., AbstractContextManager[str]]


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


def make_settings(db_url: str, backends: list[str], **kw: object) -> Settings:
    return Settings(
        database_url=db_url, backends=backends,
        upstream=UpstreamSettings(health_interval_s=0.2, **kw.pop("upstream", {})),  # type: ignore[arg-type]
        traces=kw.pop("traces", TraceSettings(flush_interval_s=0.05)), **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def gateway_at(loop_thread: LoopThread) -> Iterator[GatewayFactory]:
    """Start a gateway over ``backends``; yields its URL while the context is open."""
    stack = ExitStack()

    def start(db_url: str, backends: list[str], keep_engines: bool = False,
              **kw: object) -> AbstractContextManager[str]:
        """``keep_engines``: the engines as an earlier gateway left them (a restart);
        by default as fresh ones (engines are shared by a module's tests)."""
        if not keep_engines:
            forget_updates_of(loop_thread, backends)
        settings = make_settings(db_url, backends, **kw)
        return app_in_thread(loop_thread, lambda: create_app(settings))

    with stack:
        yield start


@pytest.fixture(scope="module")
def slow_engines(loop_thread: LoopThread) -> Iterator[list[str]]:
    """Two simulated servers slow enough (5x) that a 240-token answer spans a pause."""
    yield from two_slow_engines(loop_thread)


@pytest.fixture(scope="module")
def sim_pool(loop_thread: LoopThread) -> Iterator[list[str]]:
    """Two simulated vLLM servers (time compressed 50x), tool calls enabled."""
    yield from two_sim_servers(loop_thread)


@pytest.fixture
def scripted(loop_thread: LoopThread) -> Iterator[Callable[[Script], tuple[str, Seen]]]:
    stack = ExitStack()

    def start(script: Script) -> tuple[str, Seen]:
        seen = Seen()
        url = stack.enter_context(app_in_thread(loop_thread, lambda: make_upstream(script, seen)))
        return url, seen

    with stack:
        yield start
