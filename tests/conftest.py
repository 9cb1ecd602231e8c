"""Fixtures shared by every test: real databases (SQLite file, Postgres) migrated by Alembic.

Postgres is mandatory: when it is unreachable the Postgres tests FAIL with a message
saying how to point them at a server (``ROLLOUT_GATEWAY_TEST_POSTGRES``); they never
skip silently.
"""

from __future__ import annotations

import asyncio
import gc
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from gateway.store.db import upgrade

PG_ADMIN_DSN = os.environ.get(
    "ROLLOUT_GATEWAY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)


async def _pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated Postgres database for this test session, dropped afterwards."""
    name = f"rg_test_{uuid.uuid4().hex[:10]}"
    try:
        asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        pytest.fail(
            f"Postgres is required for these tests and is unreachable at {PG_ADMIN_DSN} "
            f"({type(exc).__name__}: {exc}). Start it or set ROLLOUT_GATEWAY_TEST_POSTGRES.",
            pytrace=False,
        )
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    url = f"{base}/{name}"
    upgrade(url)
    yield url
    asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path / 'traces.db'}"
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test using this runs once on SQLite and once on Postgres."""
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("postgres_url"))


# Property-based tests (hypothesis): ``ci`` is bounded so the stateful lifecycle tests run in
# well under a minute; ``HYPOTHESIS_PROFILE=deep`` searches longer.
settings.register_profile("ci", max_examples=150, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=500, stateful_step_count=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def closing() -> Iterator[Callable]:
    """``client = closing(openai.OpenAI(...))``: the SDK client is closed when the test ends.

    An SDK client left to the garbage collector closes its sockets late, inside whichever
    test happens to run then, and that test fails on the ResourceWarning."""
    with ExitStack() as stack:
        yield stack.enter_context


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """A socket or client a test leaves open is collected (and its ResourceWarning
    raised) in that test's own teardown, not in whichever test the collector next runs."""
    yield
    gc.collect()
