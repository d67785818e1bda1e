"""bulk batches: a bulk-schedule run's stored batches, so a Spark task run a second time (its
executor lost, a speculative copy) stores none of them twice

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import TIMESTAMP

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "bulk_batch",
        sa.Column("run", sa.Text(), primary_key=True),
        sa.Column("first_rid", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("last_rid", sa.BigInteger(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("created", sa.Integer()),
        sa.Column(
            "stored_at", TIMESTAMP(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
    )


def downgrade() -> None:
    op.drop_table("bulk_batch")
