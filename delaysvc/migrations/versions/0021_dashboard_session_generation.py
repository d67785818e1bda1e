"""dashboard sessions end at logout and at a password reset: each dashboard user gets a session
generation, carried by its session cookies and bumped by both

Revision ID: 0021
Revises: 0020

A dashboard session is a signed cookie holding the user's name; before this, a copy of it kept
working after logout and after `delaysvc create-user` set a new password, until its 12 hours
ended. The cookie now also holds the user's `session_generation` at login, and a cookie whose
generation is not the user's is no session (`delaysvc.web.ui.current_user`). Cookies made
before the upgrade hold none: their users log in again.

Lock: adding a NOT NULL column with a constant default is a change of the catalog only (no
table rewrite); it takes the small table's ACCESS EXCLUSIVE lock for a moment.
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "dashboard_user",
        sa.Column("session_generation", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("dashboard_user", "session_generation")
