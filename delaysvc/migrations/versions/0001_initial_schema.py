"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-23 06:34:34.966584
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sa.schema.CreateSequence(sa.Sequence("timer_queue_seq")))
    op.execute(sa.schema.CreateSequence(sa.Sequence("topic_queue_seq")))
    op.create_table(
        "api_token",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("token_hash", sa.Text(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("revoked_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.CheckConstraint("scope IN ('send', 'admin')", name="ck_api_token_scope"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("token_hash"),
    )
    op.create_table(
        "commit_log",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=True),
        sa.Column("tags", postgresql.ARRAY(sa.Text()), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("body_is_json", sa.Boolean(), nullable=False),
        sa.Column("properties", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("delay_level", sa.SmallInteger(), nullable=True),
        sa.Column("lane", sa.SmallInteger(), nullable=False),
        sa.Column("queue_offset", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column(
            "stored_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("deliver_ts", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("delivered_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("started_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("finished_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=True),
        sa.Column("lease_until", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("errors", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.CheckConstraint(
            "status IN ('scheduled', 'ready', 'running', 'retrying', "
            "'succeeded', 'dead', 'cancelled')",
            name="ck_commit_log_status",
        ),
        sa.PrimaryKeyConstraint("id"),
        postgresql_with={
            "fillfactor": "85",
            "autovacuum_vacuum_scale_factor": "0.01",
            "autovacuum_vacuum_insert_scale_factor": "0.01",
            "autovacuum_vacuum_cost_delay": "0",
        },
    )
    op.create_index(
        "ix_commit_log_running_lease",
        "commit_log",
        ["lease_until"],
        unique=False,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_index(
        "uq_commit_log_topic_key",
        "commit_log",
        ["topic", "key"],
        unique=True,
        postgresql_where=sa.text("key IS NOT NULL AND finished_at IS NULL"),
    )
    op.create_table(
        "consume_queue",
        sa.Column("level", sa.SmallInteger(), nullable=False),
        sa.Column("queue_offset", sa.BigInteger(), nullable=False),
        sa.Column("message_id", sa.BigInteger(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("deliver_ts", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("level", "queue_offset"),
        postgresql_partition_by="LIST (level)",
    )
    op.create_table(
        "dashboard_user",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("password_hash", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("failed_logins", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("locked_until", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.CheckConstraint("role IN ('admin', 'viewer')", name="ck_dashboard_user_role"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "dead_letter",
        sa.Column("message_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column(
            "died_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("message_id"),
    )
    op.create_index(
        "ix_dead_letter_topic_died_at", "dead_letter", ["topic", "died_at"], unique=False
    )
    op.create_table(
        "schedule_offset",
        sa.Column("lane", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("delay_ms", sa.BigInteger(), nullable=False),
        sa.Column("schedule_offset", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("moved_total", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("early_total", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_moved_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("stuck_offset", sa.BigInteger(), nullable=True),
        sa.Column("stuck_error", sa.Text(), nullable=True),
        sa.Column("stuck_since", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("lane"),
        postgresql_with={"fillfactor": "50"},
    )
    op.create_table(
        "timer_queue",
        sa.Column("deliver_ts", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("queue_offset", sa.BigInteger(), nullable=False),
        sa.Column("message_id", sa.BigInteger(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("deliver_ts", "queue_offset"),
        postgresql_with={
            "autovacuum_vacuum_scale_factor": "0.01",
            "autovacuum_vacuum_insert_scale_factor": "0.01",
            "autovacuum_vacuum_cost_delay": "0",
        },
    )
    op.create_table(
        "topic_queue",
        sa.Column("message_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column(
            "seq",
            sa.BigInteger(),
            server_default=sa.text("nextval('topic_queue_seq')"),
            nullable=False,
        ),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("deliver_ts", postgresql.TIMESTAMP(timezone=True), nullable=False),
        sa.Column(
            "enqueued_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("message_id"),
        postgresql_with={
            "autovacuum_vacuum_scale_factor": "0.01",
            "autovacuum_vacuum_insert_scale_factor": "0.01",
            "autovacuum_vacuum_cost_delay": "0",
        },
    )
    op.create_index("ix_topic_queue_topic_seq", "topic_queue", ["topic", "seq"], unique=False)
    op.create_table(
        "topic_state",
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column(
            "updated_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("topic"),
    )


def downgrade() -> None:
    op.drop_table("topic_state")
    op.drop_index("ix_topic_queue_topic_seq", table_name="topic_queue")
    op.drop_table("topic_queue")
    op.drop_table("timer_queue")
    op.drop_table("schedule_offset")
    op.drop_index("ix_dead_letter_topic_died_at", table_name="dead_letter")
    op.drop_table("dead_letter")
    op.drop_table("dashboard_user")
    op.drop_table("consume_queue")
    op.drop_index(
        "uq_commit_log_topic_key",
        table_name="commit_log",
        postgresql_where=sa.text("key IS NOT NULL AND finished_at IS NULL"),
    )
    op.drop_index(
        "ix_commit_log_running_lease",
        table_name="commit_log",
        postgresql_where=sa.text("status = 'running'"),
    )
    op.drop_table("commit_log")
    op.drop_table("api_token")
    op.execute(sa.schema.DropSequence(sa.Sequence("topic_queue_seq")))
    op.execute(sa.schema.DropSequence(sa.Sequence("timer_queue_seq")))
    # The per-level partitions went with consume_queue; their offset sequences go now.
    op.execute(
        "DO $$ DECLARE s text; BEGIN "
        "FOR s IN SELECT sequencename FROM pg_sequences WHERE schemaname = current_schema() "
        "AND sequencename ~ '^consume_queue_[0-9]+_seq$' "
        "LOOP EXECUTE format('DROP SEQUENCE %I', s); END LOOP; END $$"
    )
