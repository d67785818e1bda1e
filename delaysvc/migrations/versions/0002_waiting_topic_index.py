"""waiting messages by topic, for backlog caps

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_commit_log_waiting_topic",
        "commit_log",
        ["topic", "deliver_ts"],
        postgresql_where=sa.text("status IN ('scheduled', 'retrying')"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_commit_log_waiting_topic",
        table_name="commit_log",
        postgresql_where=sa.text("status IN ('scheduled', 'retrying')"),
    )
