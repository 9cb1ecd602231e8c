"""trajectory attempts: a finished id called again opens its next attempt

Calls carry the attempt they belong to (``seq`` restarts per attempt); the trajectory row
says which attempt it currently describes; each finished attempt keeps its reward and
metadata in ``trajectory_attempts``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 08:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempt', sa.Integer(), server_default='0',
                                      nullable=False))
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempt', sa.Integer(), server_default='0',
                                      nullable=False))
    op.create_table('trajectory_attempts',
    sa.Column('trajectory_id', sa.String(length=128), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['trajectory_id'], ['trajectories.id'],
                            name=op.f('fk_trajectory_attempts_trajectory_id_trajectories'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('trajectory_id', 'attempt', name=op.f('pk_trajectory_attempts'))
    )


def downgrade() -> None:
    op.drop_table('trajectory_attempts')
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.drop_column('attempt')
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.drop_column('attempt')
