"""calls.branch, parent_branch, kept_len, requested_model: trajectories as trees, the
prompt tokens kept from the record, and the model name a client asked for

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 02:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("calls", sa.Column("branch", sa.Integer(), server_default="0",
                                     nullable=False))
    op.add_column("calls", sa.Column("parent_branch", sa.Integer(), nullable=True))
    op.add_column("calls", sa.Column("kept_len", sa.Integer(), nullable=True))
    op.add_column("calls", sa.Column("requested_model", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        for name in ("requested_model", "kept_len", "parent_branch", "branch"):
            batch.drop_column(name)
