"""commit_log fillfactor 100 (was 85)

Measured with docs/benchmarks/scale_profile.py at 10M pending: with 85, the free space kept on
every page of a big commit_log drew the new row versions of a delivery move (status ->
ready) into old pages all over the table: 830 pages read from outside shared_buffers, dirtied
and written to WAL as full-page images for a move of 1,000 rows (21 ms; 12 ms with an empty
table). With 100 the new versions go together at the end of the table, as on an empty one:
0 read, 28 dirtied, 11.8 ms at 10M pending as at 0. The lifecycle updates (ready, running,
finished) change columns that indexes depend on, so they were never HOT: the reserved space
bought nothing. Existing pages keep their layout; new pages are filled.

Revision ID: 0006
Revises: 0005
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE commit_log SET (fillfactor = 100)")


def downgrade() -> None:
    op.execute("ALTER TABLE commit_log SET (fillfactor = 85)")
