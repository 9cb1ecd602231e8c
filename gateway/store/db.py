"""Async engine, session factory and schema migration (Alembic only, never create_all)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from gateway.store.route_files import RouteFiles

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
ROUTE_FILES = "route_files"


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str) -> AsyncEngine:
    """An async engine; SQLite gets WAL and a busy timeout so readers never block writers."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if is_sqlite(url):
        kwargs = {"connect_args": {"timeout": 30}}
    else:
        kwargs.update(pool_size=10, max_overflow=10, pool_recycle=1800,
                      connect_args={"timeout": 5, "command_timeout": 60})
    engine = create_async_engine(url, **kwargs)
    if is_sqlite(url):

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

    return engine


def make_sessionmaker(engine: AsyncEngine, route_files: RouteFiles | None = None
                      ) -> async_sessionmaker[AsyncSession]:
    """Sessions of the store; with ``route_files``, the directory its calls' routed
    experts lie in (:func:`gateway.store.queries.get_calls` reads them from there)."""
    info = {ROUTE_FILES: route_files} if route_files is not None else {}
    return async_sessionmaker(engine, expire_on_commit=False, info=info)


def route_files_of(session: AsyncSession) -> RouteFiles | None:
    """The segment files of the store ``session`` reads (:func:`make_sessionmaker`)."""
    found = session.info.get(ROUTE_FILES)
    return found if isinstance(found, RouteFiles) else None


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema at ``url`` to ``revision``. Blocking: run it in a thread from async code."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)
