"""A gateway with a managed pool (spec written to a temp file), in a background loop."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.app import create_app
from gateway.config import DispatchSettings, Settings, TraceSettings, UpstreamSettings
from gateway.runtime import Runtime
from tests.servers import LoopThread, app_in_thread

ADMIN = {"Authorization": "Bearer admin-secret"}
PoolGateway = Callable[..., AbstractContextManager["Gateway"]]


@dataclass
class Gateway:
    url: str
    app: Any  # the FastAPI app; ``app.state.runtime`` once started
    loop: LoopThread

    @property
    def rt(self) -> Runtime:
        rt: Runtime = self.app.state.runtime
        return rt


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


def pool_settings(spec_path: Path, db_url: str, policy: str | None = None,
                  **dispatch: Any) -> Settings:
    """``policy`` is the gateway's (the default when None); the rest are DispatchSettings
    (which ignores unknown keys: a policy passed there was silently dropped)."""
    return Settings(
        database_url=db_url, pool=spec_path, admin_token="admin-secret",
        **({"policy": policy} if policy is not None else {}),
        upstream=UpstreamSettings(health_interval_s=0.2, first_byte_timeout_s=300),
        traces=TraceSettings(flush_interval_s=0.05),
        dispatch=DispatchSettings(**dispatch),
    )


@pytest.fixture
def pool_gateway(loop_thread: LoopThread, sqlite_url: str, tmp_path: Path) -> PoolGateway:
    """``pool_gateway(spec_dict, **dispatch_settings)`` -> context manager yielding the URL."""

    @contextmanager
    def start(spec: dict[str, Any], policy: str | None = None,
              **dispatch: Any) -> Iterator[Gateway]:
        path = tmp_path / "pool.json"
        path.write_text(json.dumps(spec))
        app = create_app(pool_settings(path, sqlite_url, policy, **dispatch))
        with app_in_thread(loop_thread, lambda: app) as url:
            yield Gateway(url, app, loop_thread)

    return start
