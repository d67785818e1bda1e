"""API tokens may expire; the dashboard's failed logins are also counted per client

Revision ID: 0023
Revises: 0022

`api_token.expires_at` (NULL: never), set by `delaysvc create-token --expires-in`; a token past
it is refused as a revoked one is. `login_client` counts a client's failed dashboard logins in
a fixed window (`delaysvc.auth.check_login`): a client over the limit is refused before any
password is hashed, whatever names it tries (the lockout of an account stopped one name being
guessed, not one client trying many names, each attempt a full scrypt).

Downgrade: tokens made to expire are revoked first (the release before would take them for
good).

Lock: a nullable column without a default is a change of the catalog only; it takes the small
table's ACCESS EXCLUSIVE lock for a moment. The new table locks nothing else.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import TIMESTAMP

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_token", sa.Column("expires_at", TIMESTAMP(timezone=True)))
    op.create_table(
        "login_client",
        sa.Column("client", sa.Text(), primary_key=True),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("window_ends", TIMESTAMP(timezone=True), nullable=False),
    )
    op.create_index("ix_login_client_window_ends", "login_client", ["window_ends"])


def downgrade() -> None:
    op.drop_table("login_client")
    # a release without expiry would take a token made to expire (or expired) for good
    op.execute(
        "UPDATE api_token SET revoked_at = COALESCE(revoked_at, now()) WHERE expires_at IS NOT NULL"
    )
    op.drop_column("api_token", "expires_at")
