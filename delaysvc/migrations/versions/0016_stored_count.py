"""messages stored, counted exactly: a settled total up to a watermark id (`store.settle_stored`,
beat's fold) and, at scrape time, the committed rows beyond it

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_count",
        sa.Column("id", sa.SmallInteger(), nullable=False),
        sa.Column("counted", sa.BigInteger(), nullable=False),
        sa.Column("watermark", sa.BigInteger(), nullable=False),
        sa.Column("candidate", sa.BigInteger()),
        sa.Column("candidate_waits_for", ARRAY(sa.Text())),
        sa.CheckConstraint("id = 1", name="ck_stored_count_one_row"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.execute("INSERT INTO stored_count (id, counted, watermark) VALUES (1, 0, 0)")


def downgrade() -> None:
    op.drop_table("stored_count")
