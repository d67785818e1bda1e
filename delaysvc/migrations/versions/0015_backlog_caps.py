"""backlog caps in the database: at most max_waiting waiting messages in a level or a topic,
read by every producer's send (`delaysvc.producer.caps`), set by the CLI, the API and the dashboard

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "backlog_cap",
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("max_waiting", sa.BigInteger(), nullable=False),
        sa.Column("policy", sa.Text(), nullable=False),
        sa.Column(
            "updated_at",
            sa.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("scope IN ('level', 'topic')", name="ck_backlog_cap_scope"),
        sa.CheckConstraint("max_waiting > 0", name="ck_backlog_cap_max_waiting"),
        sa.CheckConstraint("policy IN ('reject', 'deliver-early')", name="ck_backlog_cap_policy"),
        sa.PrimaryKeyConstraint("scope", "target"),
    )


def downgrade() -> None:
    op.drop_table("backlog_cap")
