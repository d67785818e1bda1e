"""message history: finished messages move out of commit_log into `message_history`,
partitioned by the UTC day they finished, so retention and the archive drop a partition instead
of DELETE + VACUUM, and commit_log stays the size of what is in flight

Nothing is moved here: an install with millions of finished messages upgrades in one short
transaction (a table, a view, one partial index on commit_log), and the history sweep
(`delaysvc.maintenance.history`, run by beat) moves its finished rows over in batches afterwards,
with messages in flight. Until it has, `delaysvc.message` (both tables as one) shows every message
where it is. A later revision that adds a column to commit_log adds it to message_history
and recreates the view.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_COLUMNS = (
    "id, topic, key, tags, body, body_is_json, properties, delay_level, priority, lane, "
    "queue_offset, status, stored_at, deliver_ts, delivered_at, started_at, finished_at, "
    "attempts, duration_ms, lease_until, claim_id, last_error, errors"
)


def upgrade() -> None:
    timestamp = TIMESTAMP(timezone=True)
    op.create_table(
        "message_history",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("key", sa.Text()),
        sa.Column("tags", ARRAY(sa.Text())),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("body_is_json", sa.Boolean(), nullable=False),
        sa.Column("properties", JSONB()),
        sa.Column("delay_level", sa.SmallInteger()),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("lane", sa.SmallInteger(), nullable=False),
        sa.Column("queue_offset", sa.BigInteger()),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("stored_at", timestamp, nullable=False),
        sa.Column("deliver_ts", timestamp, nullable=False),
        sa.Column("delivered_at", timestamp),
        sa.Column("started_at", timestamp),
        sa.Column("finished_at", timestamp, nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("duration_ms", sa.Integer()),
        sa.Column("lease_until", timestamp),
        sa.Column("claim_id", sa.BigInteger()),
        sa.Column("last_error", sa.Text()),
        sa.Column("errors", JSONB()),
        postgresql_partition_by="RANGE (finished_at)",
    )
    op.create_index("ix_message_history_id", "message_history", ["id"])
    op.create_index(
        "ix_message_history_topic_key",
        "message_history",
        ["topic", "key"],
        postgresql_where=sa.text("key IS NOT NULL"),
    )
    op.create_index(
        "ix_commit_log_finished",
        "commit_log",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.execute(
        f"CREATE VIEW message AS SELECT {_COLUMNS} FROM commit_log "
        f"UNION ALL SELECT {_COLUMNS} FROM message_history"
    )


def downgrade() -> None:
    # the history goes back where it was: into commit_log, finished
    op.execute("DROP VIEW message")
    op.execute(f"INSERT INTO commit_log ({_COLUMNS}) SELECT {_COLUMNS} FROM message_history")
    op.drop_index("ix_commit_log_finished", table_name="commit_log")
    op.drop_table("message_history")  # and its partitions with it
