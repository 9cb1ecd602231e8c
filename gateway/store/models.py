"""ORM tables. The schema is created only by Alembic migrations (``migrations/``).

Token sequences are stored packed (little-endian int32 ids, float32 logprobs) and, per
call, only the prompt tokens that are new relative to the trajectory's previous
prompt+completion (``prompt_offset`` says where they start), so a trajectory's storage
grows linearly with its length.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class Trajectory(Base):
    __tablename__ = "trajectories"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    group_id: Mapped[str | None] = mapped_column(String(128), index=True)
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    reward: Mapped[float | None] = mapped_column(Float)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    #: each policy's own reward by model name, where its calls were of several (its
    #: samples of that model carry it; ``reward`` is every other sample's)
    rewards: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # the attempt this row describes: the latest one (finished_at/reward are its own)
    attempt: Mapped[int] = mapped_column(Integer, server_default="0", default=0)


class TrajectoryAttempt(Base):
    """One finished attempt of a trajectory id: its reward and metadata, kept when the id
    is reused (the trajectory row moves on to the next attempt)."""

    __tablename__ = "trajectory_attempts"

    trajectory_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("trajectories.id", ondelete="CASCADE"), primary_key=True
    )
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    finished_at: Mapped[datetime | None]
    reward: Mapped[float | None] = mapped_column(Float)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    rewards: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Call(Base):
    __tablename__ = "calls"
    __table_args__ = (
        Index("ix_calls_trajectory_seq", "trajectory_id", "seq"),
        # the calls still holding routed experts, by start (gateway/store/retention.py)
        Index("ix_calls_routes_started", "started_at",
              postgresql_where=text("routes IS NOT NULL"),
              sqlite_where=text("routes IS NOT NULL")),
        # the calls whose routed experts lie in a segment file, by segment (retention)
        Index("ix_calls_routes_file", "routes_file",
              postgresql_where=text("routes_file IS NOT NULL"),
              sqlite_where=text("routes_file IS NOT NULL")),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("trajectories.id", ondelete="CASCADE")
    )
    seq: Mapped[int] = mapped_column(Integer)  # order within the attempt, from 0
    attempt: Mapped[int] = mapped_column(Integer, server_default="0", default=0)
    endpoint: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(256))
    backend_id: Mapped[str | None] = mapped_column(String(128))
    backend_url: Mapped[str | None] = mapped_column(String(512))
    tp: Mapped[int | None] = mapped_column(Integer)
    weight_version: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    started_at: Mapped[datetime]
    queued_ms: Mapped[float] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float] = mapped_column(Float)
    prompt_len: Mapped[int] = mapped_column(Integer)
    prompt_offset: Mapped[int] = mapped_column(Integer)
    prompt_delta: Mapped[bytes] = mapped_column(LargeBinary)
    completion_ids: Mapped[bytes] = mapped_column(LargeBinary)
    completion_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)
    mismatch_pos: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    extra_choices: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    request_messages: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    completion_text: Mapped[str | None] = mapped_column(Text)
    weight_segments: Mapped[list[Any] | None] = mapped_column(JSON)
    # the trajectory as a tree (gateway/trajectories/branches.py): the call's branch, and
    # on a branch's first call the branch it forked from (prompt_offset is then the fork)
    branch: Mapped[int] = mapped_column(Integer, server_default="0", default=0)
    parent_branch: Mapped[int | None] = mapped_column(Integer)
    # prompt tokens the engine ran from the record instead of the harness's rendering
    kept_len: Mapped[int | None] = mapped_column(Integer)
    # the model name the client asked for, when an alias mapped it to ``model``
    requested_model: Mapped[str | None] = mapped_column(String(256))
    #: a forced tool call or structured output: its logprobs are of a masked distribution
    constrained: Mapped[str | None] = mapped_column(String(32))
    # routed experts (MoE routing replay): a ``.npy`` of (positions, layers, top_k) expert
    # ids, uint8 up to 256 experts, from position ``routes_start`` of the call's prompt
    # and completion (gateway/proxy/routes.py): in ``routes`` (traces.routes_store
    # "database"), or ``routes_length`` bytes at ``routes_offset`` of the segment file
    # ``routes_file`` (gateway/store/route_files.py, the default)
    routes_start: Mapped[int | None] = mapped_column(Integer)
    routes: Mapped[bytes | None] = mapped_column(LargeBinary)
    routes_file: Mapped[str | None] = mapped_column(String(64))
    routes_offset: Mapped[int | None] = mapped_column(BigInteger)
    routes_length: Mapped[int | None] = mapped_column(Integer)
