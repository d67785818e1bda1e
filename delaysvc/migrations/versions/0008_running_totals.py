"""running totals for /metrics: lateness per lane, handler durations and outcomes per topic

- `lateness_total` (lane) and `topic_total` (topic): histogram buckets and the sum of the
  observed values (ms) since the database was created, and per topic the jobs that succeeded,
  were scheduled for a retry or went to the dead letters. The minute rows of
  `lateness_histogram` and `handler_duration_histogram` are pruned after a week, so /metrics,
  which summed them, saw its buckets go down; these rows only grow.
- Existing data is kept: the totals start from the minute rows still kept. The sum of those
  older observations and their outcomes were never recorded, so they start at 0 (Prometheus
  reads rates of change, which are exact from here on).

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# bucket counts summed over every kept minute of each key
_SEED = """
INSERT INTO {total} ({key}, {counts})
SELECT {key}, array_agg(total ORDER BY i) FROM (
    SELECT {key}, i, CAST(sum(c) AS bigint) AS total
    FROM {minutes}, unnest(counts) WITH ORDINALITY AS u(c, i) GROUP BY {key}, i
) t GROUP BY {key}
"""


def upgrade() -> None:
    op.create_table(
        "lateness_total",
        sa.Column("lane", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("counts", postgresql.ARRAY(sa.BigInteger()), nullable=False),
        sa.Column("sum_ms", sa.Float(), server_default=sa.text("0"), nullable=False),
        sa.PrimaryKeyConstraint("lane"),
        postgresql_with={"fillfactor": "50"},
    )
    op.create_table(
        "topic_total",
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column(
            "duration_counts",
            postgresql.ARRAY(sa.BigInteger()),
            server_default=sa.text("'{}'"),
            nullable=False,
        ),
        sa.Column("duration_sum_ms", sa.Float(), server_default=sa.text("0"), nullable=False),
        sa.Column("succeeded", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("retried", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("dead", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.PrimaryKeyConstraint("topic"),
        postgresql_with={"fillfactor": "50"},
    )
    op.execute(
        _SEED.format(
            total="lateness_total", key="lane", counts="counts", minutes="lateness_histogram"
        )
    )
    op.execute(
        _SEED.format(
            total="topic_total",
            key="topic",
            counts="duration_counts",
            minutes="handler_duration_histogram",
        )
    )


def downgrade() -> None:
    op.drop_table("topic_total")
    op.drop_table("lateness_total")
