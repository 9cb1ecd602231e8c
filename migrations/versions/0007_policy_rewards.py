"""trajectories.rewards, trajectory_attempts.rewards: each policy's own reward, by model
name, where a trajectory's calls were of several policies (a solver and a verifier); and
ix_calls_routes_started, the calls that still hold routed experts by start time (what the
routes retention looks up)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("trajectories", sa.Column("rewards", sa.JSON(), nullable=True))
    op.add_column("trajectory_attempts", sa.Column("rewards", sa.JSON(), nullable=True))
    held = sa.text("routes IS NOT NULL")
    op.create_index("ix_calls_routes_started", "calls", ["started_at"],
                    postgresql_where=held, sqlite_where=held)


def downgrade() -> None:
    op.drop_index("ix_calls_routes_started", table_name="calls")
    with op.batch_alter_table("trajectory_attempts") as batch:
        batch.drop_column("rewards")
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_column("rewards")
