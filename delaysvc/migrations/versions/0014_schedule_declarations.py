"""periodic schedules declared in code: when and by which worker each was last declared

A delivery worker declares its handler modules' schedules when it starts and again every
minute; a code-declared schedule that no worker has declared for a while is removed
(`delaysvc.maintenance.periodic.UNDECLARED_GRACE`). The code-declared schedules already stored
count as declared now: the workers of every team have the grace to declare theirs again.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "periodic_schedule", sa.Column("declared_at", sa.TIMESTAMP(timezone=True), nullable=True)
    )
    op.add_column("periodic_schedule", sa.Column("declared_by", sa.Text(), nullable=True))
    op.execute("UPDATE periodic_schedule SET declared_at = now() WHERE declared_in = 'code'")
    op.create_check_constraint(
        "ck_periodic_schedule_declared_at",
        "periodic_schedule",
        "(declared_in = 'code') = (declared_at IS NOT NULL)",
    )


def downgrade() -> None:
    op.drop_constraint("ck_periodic_schedule_declared_at", "periodic_schedule", type_="check")
    op.drop_column("periodic_schedule", "declared_by")
    op.drop_column("periodic_schedule", "declared_at")
