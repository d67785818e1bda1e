"""Celery revokes by stamped headers are remembered too: a stored task carrying a revoked stamp
is dropped when due

Revision ID: 0024
Revises: 0023

`app.control.revoke_by_stamped_headers({"header": value})` reached Celery's workers only: a
stored task with the stamp was published when due, and revoked only by a worker that still
remembered the stamps (Celery keeps them in memory; a restart forgets them). The handler of
`celery.*` now also drops a message whose stamps are in `celery_revoked_stamp`. A new table and
its index: no lock on any other.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import TIMESTAMP

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "celery_revoked_stamp",
        sa.Column("header", sa.Text(), primary_key=True),
        sa.Column("value", sa.Text(), primary_key=True),
        sa.Column(
            "revoked_at", TIMESTAMP(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
    )
    op.create_index("ix_celery_revoked_stamp_revoked_at", "celery_revoked_stamp", ["revoked_at"])


def downgrade() -> None:
    op.drop_table("celery_revoked_stamp")
