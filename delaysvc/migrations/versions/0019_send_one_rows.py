"""`send_one` is declared to return one row (`ROWS 1`), so a statement that calls it for each
of several messages (`store.insert_group`, group commit) keeps one plan instead of planning
itself again on every call

Revision ID: 0019
Revises: 0018

PostgreSQL estimates a set-returning function at 1,000 rows unless told otherwise. The group
statement calls `send_one` once per message of an array (`unnest ... LEFT JOIN LATERAL
send_one(...)`): its generic plan, made for an array of unknown length, was estimated at ten
times a thousand rows, far above any plan made for the array at hand, so the plan cache never
took it and planned the statement again each time, ~85 us of the server's CPU a group on this
machine (docs/benchmarks/2026-11-28-group-commit). `send_one` returns one row, or none (a key
held), so the estimate is now the truth. Nothing else calls it in a way the estimate changes.
No lock beyond a moment's on the function.
"""

from alembic import op
from sqlalchemy import text

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_SIGNATURE = (
    "send_one(text, text, text[], bytea, boolean, jsonb, smallint, smallint, integer, bigint, "
    "timestamptz, boolean)"
)


def _schema() -> str:
    """The schema being migrated (env.py sets the search_path to it for the revision)."""
    name = op.get_bind().execute(text("SELECT current_schema()")).scalar_one()
    return '"' + name.replace('"', '""') + '"'


def upgrade() -> None:
    op.execute(f"ALTER FUNCTION {_schema()}.{_SIGNATURE} ROWS 1")


def downgrade() -> None:
    op.execute(f"ALTER FUNCTION {_schema()}.{_SIGNATURE} ROWS 1000")
