"""exact lane counts (lane_count deltas), claim tokens, topic-limited API tokens

- `lane_count`: the waiting messages of each lane as deltas, appended by every statement that
  puts messages into a lane or takes them out, in that statement's transaction, and folded into
  one row per lane now and then. Offsets gave an upper bound only (a row sent in a transaction
  still open while later offsets were moved sits behind the schedule offset; rolled-back sends
  and cancels leave holes), so the backlog figures and the level caps could be wrong. Existing
  messages are counted here, once.
- `commit_log.claim_id`: the claim that holds a running job (every later state change names
  it, so a job taken over after its lease can never be finished by the old holder); attempts
  are counted when a handler starts, not when a batch is claimed.
- `api_token.topics`: the topics a token may act on (NULL: all).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lane_count",
        sa.Column("lane", sa.SmallInteger(), nullable=False),
        sa.Column("delta", sa.BigInteger(), nullable=False),
        postgresql_with={
            "autovacuum_vacuum_scale_factor": "0.01",
            "autovacuum_vacuum_insert_scale_factor": "0.01",
            "autovacuum_vacuum_cost_delay": "0",
        },
    )
    op.execute(
        "INSERT INTO lane_count (lane, delta) "
        "SELECT level, count(*) FROM consume_queue GROUP BY level "
        "UNION ALL SELECT 0, count(*) FROM timer_queue HAVING count(*) > 0"
    )
    op.execute("CREATE SEQUENCE claim_seq")
    op.add_column("commit_log", sa.Column("claim_id", sa.BigInteger(), nullable=True))
    op.add_column("api_token", sa.Column("topics", postgresql.ARRAY(sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("api_token", "topics")
    op.drop_column("commit_log", "claim_id")
    op.execute("DROP SEQUENCE claim_seq")
    op.drop_table("lane_count")
