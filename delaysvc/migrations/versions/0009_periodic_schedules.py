"""periodic schedules: one row per schedule, its next tick advanced as each tick is fired

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    timestamp = sa.TIMESTAMP(timezone=True)
    op.create_table(
        "periodic_schedule",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("body_is_json", sa.Boolean(), nullable=False),
        sa.Column("cron", sa.Text(), nullable=True),
        sa.Column("every_ms", sa.BigInteger(), nullable=True),
        sa.Column("timezone", sa.Text(), server_default=sa.text("'UTC'"), nullable=False),
        sa.Column("on_missed", sa.Text(), server_default=sa.text("'skip'"), nullable=False),
        sa.Column("declared_in", sa.Text(), nullable=False),
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("next_tick", timestamp, nullable=False),
        sa.Column("last_tick", timestamp, nullable=True),
        sa.Column("last_message_id", sa.BigInteger(), nullable=True),
        sa.Column("created_at", timestamp, server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", timestamp, server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "(cron IS NULL) <> (every_ms IS NULL)", name="ck_periodic_schedule_spec"
        ),
        sa.CheckConstraint(
            "on_missed IN ('skip', 'latest')", name="ck_periodic_schedule_on_missed"
        ),
        sa.CheckConstraint(
            "declared_in IN ('code', 'api')", name="ck_periodic_schedule_declared_in"
        ),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_index(
        "ix_periodic_schedule_next_tick",
        "periodic_schedule",
        ["next_tick"],
        postgresql_where=sa.text("NOT paused"),
    )


def downgrade() -> None:
    op.drop_index("ix_periodic_schedule_next_tick", table_name="periodic_schedule")
    op.drop_table("periodic_schedule")
