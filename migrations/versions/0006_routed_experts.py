"""calls.routes_start, calls.routes: the routed experts a mixture-of-experts engine
returned for the call (MoE routing replay), one ``.npy`` of expert ids per call

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 03:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("calls", sa.Column("routes_start", sa.Integer(), nullable=True))
    op.add_column("calls", sa.Column("routes", sa.LargeBinary(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":  # expert ids barely compress: no pglz
        op.execute("ALTER TABLE calls ALTER COLUMN routes SET STORAGE EXTERNAL")


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("routes")
        batch.drop_column("routes_start")
