"""heartbeats of beat and consumers, handler-duration histogram, retrying-by-topic index

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TS = postgresql.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.create_table(
        "handler_duration_histogram",
        sa.Column("minute", TS, nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("counts", postgresql.ARRAY(sa.BigInteger()), nullable=False),
        sa.Column("max_ms", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("minute", "topic"),
    )
    op.create_table(
        "heartbeat",
        sa.Column("component", sa.Text(), nullable=False),
        sa.Column("seen_at", TS, nullable=False),
        sa.Column("host", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("component"),
        postgresql_with={"fillfactor": "50"},
    )

    op.create_index(
        "ix_commit_log_retrying_topic",
        "commit_log",
        ["topic"],
        postgresql_where=sa.text("status = 'retrying'"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_commit_log_retrying_topic",
        table_name="commit_log",
        postgresql_where=sa.text("status = 'retrying'"),
    )
    op.drop_table("heartbeat")
    op.drop_table("handler_duration_histogram")
