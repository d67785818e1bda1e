"""dead_letter.error: the error a letter is grouped by, kept on the letter

The dashboard groups dead letters by (topic, error), the error being the last handler error,
else the reason the letter died. Read through commit_log that is one primary-key probe per
letter (about 0.5 s over 50k letters beside 10M messages); kept on the letter, the grouping
reads dead_letter alone.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("dead_letter", sa.Column("error", sa.Text(), nullable=True))
    op.execute(
        "UPDATE dead_letter d SET error = COALESCE(c.last_error, d.reason) "
        "FROM commit_log c WHERE c.id = d.message_id"
    )
    op.execute("UPDATE dead_letter SET error = reason WHERE error IS NULL")
    op.alter_column("dead_letter", "error", nullable=False)


def downgrade() -> None:
    op.drop_column("dead_letter", "error")
