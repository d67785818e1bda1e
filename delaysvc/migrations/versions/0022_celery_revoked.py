"""Celery tasks revoked through `delaysvc.contrib.celery` are remembered, so a message of the
task is dropped when it comes due, whenever it was stored

Revision ID: 0022
Revises: 0021

`revoke` cancelled the task's stored messages it found: the task's own and its first 100
retries. A retry the task stored while it ran, after its revoke, and a retry past the 100th,
stayed due, and were published; a worker that no longer remembered the revoke (restarted;
Celery keeps one for 3 h) ran the task again. The handler of `celery.*` now drops a message of
a task in `celery_revoked`. A new table and its index: no lock on any other.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import TIMESTAMP

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "celery_revoked",
        sa.Column("task_id", sa.Text(), primary_key=True),
        sa.Column(
            "revoked_at", TIMESTAMP(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
    )
    op.create_index("ix_celery_revoked_revoked_at", "celery_revoked", ["revoked_at"])


def downgrade() -> None:
    op.drop_table("celery_revoked")
