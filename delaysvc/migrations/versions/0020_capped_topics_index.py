"""the commit log's index of every waiting message by topic dropped: the capped topics' waiting
messages get an index of their own, made to fit the topic caps

Revision ID: 0020
Revises: 0019

`ix_commit_log_waiting_topic` (topic, deliver_ts), on every waiting message, is read only by the
topic caps (their count and their early delivery), yet every send wrote into it: 0.84 us of a
batch row's COPY into the commit log, the dearest of its indexes after the primary key
(docs/benchmarks/2026-11-27-batch-write-costs), and about a tenth of a `send_batch` of 10,000
(docs/benchmarks/2026-12-02-capped-topics-index). The index that takes its place
(`tables.CAPPED_INDEX_PREFIX`) names the capped topics in its predicate and is made by
`delaysvc.maintenance.caps_index` whenever they change (`delaysvc migrate` runs it after this):
a send to a topic without a cap writes nothing into it.

Lock: dropping the index takes the commit log's ACCESS EXCLUSIVE lock for a moment. The
downgrade builds the old index again inside its transaction, sends waiting meanwhile.
"""

from alembic import op
from sqlalchemy import text

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_PREFIX = "ix_commit_log_capped_"


def upgrade() -> None:
    op.drop_index("ix_commit_log_waiting_topic", table_name="commit_log")


def downgrade() -> None:
    capped = op.get_bind().execute(
        text(
            "SELECT i.relname FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
            "WHERE x.indrelid = CAST('commit_log' AS regclass) AND starts_with(i.relname, :p)"
        ),
        {"p": _PREFIX},
    )
    for (name,) in capped.all():
        op.drop_index(name, table_name="commit_log")
    op.execute(
        "CREATE INDEX ix_commit_log_waiting_topic ON commit_log (topic, deliver_ts) "
        "WHERE status IN ('scheduled', 'retrying')"
    )
