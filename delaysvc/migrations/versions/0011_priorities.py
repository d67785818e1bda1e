"""priorities: a message's priority (default 0) travels with it through the lanes into its
topic's queue, whose claims take the highest first, then queue order

Adding a column with a constant default rewrites no table (PostgreSQL 11 and later). The topic
queue's index is built anew with the priority in it, then the old one dropped.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_TABLES = ("commit_log", "consume_queue", "timer_queue", "topic_queue")


def upgrade() -> None:
    for table in _TABLES:
        op.add_column(
            table,
            sa.Column("priority", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        )
    op.create_index(
        "ix_topic_queue_topic_priority_seq",
        "topic_queue",
        ["topic", sa.text("priority DESC"), "seq"],
    )
    op.drop_index("ix_topic_queue_topic_seq", table_name="topic_queue")


def downgrade() -> None:
    op.create_index("ix_topic_queue_topic_seq", "topic_queue", ["topic", "seq"])
    op.drop_index("ix_topic_queue_topic_priority_seq", table_name="topic_queue")
    for table in reversed(_TABLES):
        op.drop_column(table, "priority")
