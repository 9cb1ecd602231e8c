"""calls.constrained: a forced tool call or structured output, whose recorded logprobs
are those of the distribution the engine masked to the grammar

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28 08:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("calls", sa.Column("constrained", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("constrained")
