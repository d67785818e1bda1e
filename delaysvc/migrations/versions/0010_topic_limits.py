"""per-topic limits: jobs running at once (max_running) and starts per second (rate_per_s, a
token bucket in tokens and tokens_at), checked by every claim under the topic_state row's lock

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("topic_state", sa.Column("max_running", sa.Integer(), nullable=True))
    op.add_column("topic_state", sa.Column("rate_per_s", sa.Float(), nullable=True))
    op.add_column("topic_state", sa.Column("tokens", sa.Float(), nullable=True))
    op.add_column("topic_state", sa.Column("tokens_at", sa.TIMESTAMP(timezone=True), nullable=True))
    op.create_check_constraint("ck_topic_state_max_running", "topic_state", "max_running > 0")
    op.create_check_constraint("ck_topic_state_rate_per_s", "topic_state", "rate_per_s > 0")


def downgrade() -> None:
    op.drop_constraint("ck_topic_state_rate_per_s", "topic_state")
    op.drop_constraint("ck_topic_state_max_running", "topic_state")
    for column in ("tokens_at", "tokens", "rate_per_s", "max_running"):
        op.drop_column("topic_state", column)
