"""a message's status is checked by a domain, `message_status`, instead of a CHECK on the
commit log: a single send's database work drops by about a seventh

Revision ID: 0018
Revises: 0017

PostgreSQL compiles a table's CHECK constraints again for every statement that writes the
table: a one-row insert into a table with `CHECK (status IN (...))` cost 13.4-17.1 us of the
server's CPU against 2.5-4.0 us without it, and `send_one` 87.9 us against 74.6 us
(docs/benchmarks/2026-11-27-send-one-costs). A domain's rule is compiled once per server
connection and kept in its type cache: the same rule on a domain over text cost 3.1-4.8 us. The
column stays text to every reader (PostgreSQL describes a domain column by its base type), and
the rule is the same: a status outside `tables.STATUSES` is refused by any statement.

The change: the domain, with no rule yet, so that the type change rewrites neither table; the
commit log's CHECK dropped; both tables' `status` (the history's too: the `message` view and the
dashboard's pages are a UNION ALL of the two, which PostgreSQL flattens only while the
columns' types are the same) made the domain; then the rule added to the domain, NOT VALID
(every stored status was written under the CHECK). The `message` view names `status`, so it is
dropped and made again from its own definition.

Lock: the commit log is locked (ACCESS EXCLUSIVE) for this revision's transaction, and the three
partial indexes whose predicates name `status` are built again inside it
(`ix_commit_log_waiting_topic` holds every waiting message; `ix_commit_log_running_lease`, the
running ones; `ix_commit_log_retrying_topic`, the retrying ones): sends wait for as long as
those builds take over the backlog: 3.5-3.8 s for 1,000,000 waiting messages on a 2-core
machine (docs/benchmarks/2026-11-28-status-domain; docs/how-to/upgrades.md says so).
"""

from alembic import op
from sqlalchemy import text

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

STATUSES = ("scheduled", "ready", "running", "retrying", "succeeded", "dead", "cancelled")
_RULE = "IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")"


def _view_definition() -> str:
    """The `message` view's SELECT, as the database holds it (the view is made again after the
    column types change)."""
    return op.get_bind().execute(text("SELECT pg_get_viewdef(to_regclass('message'))")).scalar_one()


def upgrade() -> None:
    view = _view_definition()
    op.execute("DROP VIEW message")
    op.execute("CREATE DOMAIN message_status AS text")
    op.execute("ALTER TABLE commit_log DROP CONSTRAINT ck_commit_log_status")
    op.execute("ALTER TABLE commit_log ALTER COLUMN status TYPE message_status")
    op.execute("ALTER TABLE message_history ALTER COLUMN status TYPE message_status")
    op.execute(
        f"ALTER DOMAIN message_status ADD CONSTRAINT ck_message_status CHECK (VALUE {_RULE}) "
        "NOT VALID"
    )
    op.execute(f"CREATE VIEW message AS {view}")


def downgrade() -> None:
    view = _view_definition()
    op.execute("DROP VIEW message")
    op.execute("ALTER TABLE commit_log ALTER COLUMN status TYPE text")
    op.execute("ALTER TABLE message_history ALTER COLUMN status TYPE text")
    op.execute(f"ALTER TABLE commit_log ADD CONSTRAINT ck_commit_log_status CHECK (status {_RULE})")
    op.execute("DROP DOMAIN message_status")
    op.execute(f"CREATE VIEW message AS {view}")
