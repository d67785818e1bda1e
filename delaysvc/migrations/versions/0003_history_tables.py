"""history: stats samples, lateness histogram, pipeline runs, hourly report

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TS = postgresql.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.create_table(
        "stats_sample",
        sa.Column("sampled_at", TS, nullable=False),
        sa.Column("lane", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("pending", sa.BigInteger(), nullable=False),
        sa.Column("moved_total", sa.BigInteger(), nullable=False),
        sa.Column("early_total", sa.BigInteger(), nullable=False),
        sa.Column("head_lateness_ms", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("sampled_at", "lane"),
    )
    op.create_table(
        "lateness_histogram",
        sa.Column("minute", TS, nullable=False),
        sa.Column("lane", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("counts", postgresql.ARRAY(sa.BigInteger()), nullable=False),
        sa.Column("max_ms", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("minute", "lane"),
    )
    op.create_table(
        "pipeline_run",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'running'"), nullable=False),
        sa.Column("started_at", TS, server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column(
            "params",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("range_from_id", sa.BigInteger(), nullable=True),
        sa.Column("range_to_id", sa.BigInteger(), nullable=True),
        sa.Column("rows_read", sa.BigInteger(), nullable=True),
        sa.Column("rows_written", sa.BigInteger(), nullable=True),
        sa.Column("rows_rejected", sa.BigInteger(), nullable=True),
        sa.Column("checksum", sa.Text(), nullable=True),
        sa.Column("output_path", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "kind IN ('archive', 'report', 'bulk-schedule')", name="ck_pipeline_run_kind"
        ),
        sa.CheckConstraint(
            "status IN ('running', 'succeeded', 'failed')", name="ck_pipeline_run_status"
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "report_hourly",
        sa.Column("hour", TS, nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("level", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("messages", sa.BigInteger(), nullable=False),
        sa.Column("lateness_p50_ms", sa.Float(), nullable=True),
        sa.Column("lateness_p95_ms", sa.Float(), nullable=True),
        sa.Column("lateness_p99_ms", sa.Float(), nullable=True),
        sa.Column("lateness_max_ms", sa.Float(), nullable=True),
        sa.Column("duration_p50_ms", sa.Float(), nullable=True),
        sa.Column("duration_p95_ms", sa.Float(), nullable=True),
        sa.Column("duration_p99_ms", sa.Float(), nullable=True),
        sa.Column("retried", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("dead", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("hour", "topic", "level"),
    )


def downgrade() -> None:
    op.drop_table("report_hourly")
    op.drop_table("pipeline_run")
    op.drop_table("lateness_histogram")
    op.drop_table("stats_sample")
