"""calls.routes_file, routes_offset, routes_length: where a call's routed experts lie in
an append-only segment file beside the database (gateway/store/route_files.py), the
default store for them from now on; ix_calls_routes_file finds a segment's calls (the
retention deletes whole segments)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("calls", sa.Column("routes_file", sa.String(64), nullable=True))
    op.add_column("calls", sa.Column("routes_offset", sa.BigInteger(), nullable=True))
    op.add_column("calls", sa.Column("routes_length", sa.Integer(), nullable=True))
    held = sa.text("routes_file IS NOT NULL")
    op.create_index("ix_calls_routes_file", "calls", ["routes_file"],
                    postgresql_where=held, sqlite_where=held)


def downgrade() -> None:
    op.drop_index("ix_calls_routes_file", table_name="calls")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("routes_length")
        batch.drop_column("routes_offset")
        batch.drop_column("routes_file")
