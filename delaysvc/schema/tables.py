"""The tables, as SQLAlchemy Core metadata. Alembic migrations create them; a test checks that the
migrated schema matches this file.

Hot tables (commit_log, consume_queue_*, timer_queue, topic_queue) have no foreign keys and no
triggers, tuned autovacuum, and every statement on them goes through an index that puts the
head first, so dead tuples left by churn are not walked (docs/explanation/design.md, "Tables
that churn without bloating").

Lanes: a message waits in exactly one lane until it is delivered. Lane N (1..max level) is the
FIFO consume queue of delay level N, a partition `consume_queue_N` of `consume_queue` ordered by
`queue_offset`; lane 0 is the timer lane for arbitrary delays, ordered by `deliver_ts`.
"""

from datetime import date

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Sequence,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, DOMAIN, JSONB, TIMESTAMP

metadata = MetaData()
Timestamp = TIMESTAMP(timezone=True)

TIMER_LANE = 0
NO_LANE = -1
STATUSES = ("scheduled", "ready", "running", "retrying", "succeeded", "dead", "cancelled")
WAITING = ("scheduled", "retrying")
FINISHED = ("succeeded", "dead", "cancelled")
HOT_TABLE_STORAGE = {
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_insert_scale_factor": "0.01",
    "autovacuum_vacuum_cost_delay": "0",
}


# A message's status: text, whose rule is a domain's rather than a table CHECK, because
# PostgreSQL compiles a table's CHECKs again for every statement that writes it and keeps a
# domain's compiled per connection (migration 0018: a seventh of a single send's database work).
MessageStatus = DOMAIN(
    "message_status",
    Text,
    constraint_name="ck_message_status",
    check="VALUE IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")",
    create_type=False,
)


commit_log = Table(
    "commit_log",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("topic", Text, nullable=False),
    Column("key", Text),
    Column("tags", ARRAY(Text)),
    Column("body", LargeBinary, nullable=False),
    Column("body_is_json", Boolean, nullable=False),
    Column("properties", JSONB),
    Column("delay_level", SmallInteger),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    Column("lane", SmallInteger, nullable=False),
    Column("queue_offset", BigInteger),
    Column("status", MessageStatus, nullable=False),
    Column("stored_at", Timestamp, nullable=False, server_default=text("now()")),
    Column("deliver_ts", Timestamp, nullable=False),
    Column("delivered_at", Timestamp),
    Column("started_at", Timestamp),
    Column("finished_at", Timestamp),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("duration_ms", Integer),
    Column("lease_until", Timestamp),
    Column("claim_id", BigInteger),
    Column("last_error", Text),
    Column("errors", JSONB),
    Index(
        "uq_commit_log_topic_key",
        "topic",
        "key",
        unique=True,
        postgresql_where=text("key IS NOT NULL AND finished_at IS NULL"),
    ),
    Index(
        "ix_commit_log_running_lease", "lease_until", postgresql_where=text("status = 'running'")
    ),
    # (the waiting messages of the capped topics, oldest first, are indexed by an index made to
    # fit the caps: CAPPED_INDEX_PREFIX below)
    # retrying messages per topic (the dashboard's and /api/v1/topics' retrying counts)
    Index("ix_commit_log_retrying_topic", "topic", postgresql_where=text("status = 'retrying'")),
    # finished messages not yet moved into message_history, oldest first
    # (`delaysvc.maintenance.history`)
    Index(
        "ix_commit_log_finished", "finished_at", postgresql_where=text("finished_at IS NOT NULL")
    ),
    # 100: no free space kept on each page, which drew the new versions of delivered rows into
    # old pages all over a big table (migration 0006 has the measurement)
    postgresql_with={"fillfactor": "100", **HOT_TABLE_STORAGE},
)

CAPPED_INDEX_PREFIX = "ix_commit_log_capped_"
"""The waiting messages of the topics a backlog cap covers, oldest first, indexed by
(topic, deliver_ts) with the capped topics in the index's predicate: a topic cap counts and
delivers early by it, and a send to any other topic writes nothing into it. No migration makes
it: `delaysvc.maintenance.caps_index` builds it again whenever the topic caps change (migration
0020 has the measurement)."""

# Finished messages, moved out of commit_log in batches by `delaysvc.maintenance.history` (beat's
# `move_history`, every few seconds), so commit_log holds the messages in flight and stays the
# size of the backlog however much history piles up. Partitioned by the UTC day each message
# finished (`message_history_YYYYMMDD`, made ahead by the same sweep): retention and the archive
# drop a day's partition, never DELETE + VACUUM. No primary key (one would have to include
# finished_at): ids are unique because each row is moved once, in one transaction with its
# delete from commit_log. `delaysvc.message` (a view, migration 0013) is both tables as one:
# every reader of a message that may have finished reads it there.
message_history = Table(
    "message_history",
    metadata,
    *(
        Column(c.name, c.type, nullable=c.nullable and c.name != "finished_at")
        for c in commit_log.columns
    ),
    Index("ix_message_history_id", "id"),
    Index("ix_message_history_topic_key", "topic", "key", postgresql_where=text("key IS NOT NULL")),
    postgresql_partition_by="RANGE (finished_at)",
)
MESSAGE_VIEW = "message"

consume_queue = Table(
    "consume_queue",
    metadata,
    Column("level", SmallInteger, primary_key=True),
    Column("queue_offset", BigInteger, primary_key=True),
    Column("message_id", BigInteger, nullable=False),
    Column("topic", Text, nullable=False),
    Column("deliver_ts", Timestamp, nullable=False),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    postgresql_partition_by="LIST (level)",
)

timer_queue_seq = Sequence("timer_queue_seq", metadata=metadata)
timer_queue = Table(
    "timer_queue",
    metadata,
    Column("deliver_ts", Timestamp, primary_key=True),
    Column("queue_offset", BigInteger, primary_key=True),
    Column("message_id", BigInteger, nullable=False),
    Column("topic", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    postgresql_with=HOT_TABLE_STORAGE,
)

topic_queue_seq = Sequence("topic_queue_seq", metadata=metadata)
topic_queue = Table(
    "topic_queue",
    metadata,
    Column("message_id", BigInteger, primary_key=True, autoincrement=False),
    Column(
        "seq",
        BigInteger,
        nullable=False,
        server_default=text("nextval('delaysvc.topic_queue_seq')"),
    ),
    Column("topic", Text, nullable=False),
    Column("deliver_ts", Timestamp, nullable=False),
    Column("enqueued_at", Timestamp, nullable=False, server_default=text("now()")),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    # claims take the highest priority first, then queue order
    Index("ix_topic_queue_topic_priority_seq", "topic", text("priority DESC"), "seq"),
    postgresql_with=HOT_TABLE_STORAGE,
)

schedule_offset = Table(
    "schedule_offset",
    metadata,
    Column("lane", SmallInteger, primary_key=True, autoincrement=False),
    Column("delay_ms", BigInteger, nullable=False),
    Column("schedule_offset", BigInteger, nullable=False, server_default=text("0")),
    Column("moved_total", BigInteger, nullable=False, server_default=text("0")),
    Column("early_total", BigInteger, nullable=False, server_default=text("0")),
    Column("last_moved_at", Timestamp),
    Column("stuck_offset", BigInteger),
    Column("stuck_error", Text),
    Column("stuck_since", Timestamp),
    postgresql_with={"fillfactor": "50"},
)

dead_letter = Table(
    "dead_letter",
    metadata,
    Column("message_id", BigInteger, primary_key=True, autoincrement=False),
    Column("topic", Text, nullable=False),
    Column("died_at", Timestamp, nullable=False, server_default=text("now()")),
    Column("reason", Text, nullable=False),
    Column("attempts", Integer, nullable=False),
    # what the letter is grouped by: the last handler error, else the reason
    Column("error", Text, nullable=False),
    Index("ix_dead_letter_topic_died_at", "topic", "died_at"),
)

claim_seq = Sequence("claim_seq", metadata=metadata)

# The waiting messages of each lane, as deltas: every statement that puts messages into a lane or
# takes them out appends one row per lane it changed, in its own transaction, and
# `store.fold_lane_counts` folds them into one row per lane. Appending never waits on another
# writer (a counter row updated in place would serialise every send of a level, and a producer's
# long transaction would hold it); the sum is exact at any snapshot.
lane_count = Table(
    "lane_count",
    metadata,
    Column("lane", SmallInteger, nullable=False),
    Column("delta", BigInteger, nullable=False),
    postgresql_with=HOT_TABLE_STORAGE,
)

topic_state = Table(
    "topic_state",
    metadata,
    Column("topic", Text, primary_key=True),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    Column("updated_at", Timestamp, nullable=False, server_default=text("now()")),
    # limits (`delaysvc.worker.limits`): jobs running at once, and starts per second (a token bucket
    # of one second's starts, `tokens` as of `tokens_at`), both checked under this row's lock
    Column("max_running", Integer),
    Column("rate_per_s", Float),
    Column("tokens", Float),
    Column("tokens_at", Timestamp),
    CheckConstraint("max_running > 0", name="ck_topic_state_max_running"),
    CheckConstraint("rate_per_s > 0", name="ck_topic_state_rate_per_s"),
)

backlog_cap = Table(
    "backlog_cap",
    metadata,
    # at most max_waiting waiting messages in a level (target: its number) or a topic, read by
    # every producer's send (`delaysvc.producer.caps`)
    Column("scope", Text, primary_key=True),
    Column("target", Text, primary_key=True),
    Column("max_waiting", BigInteger, nullable=False),
    Column("policy", Text, nullable=False),
    Column("updated_at", Timestamp, nullable=False, server_default=text("now()")),
    CheckConstraint("scope IN ('level', 'topic')", name="ck_backlog_cap_scope"),
    CheckConstraint("max_waiting > 0", name="ck_backlog_cap_max_waiting"),
    CheckConstraint("policy IN ('reject', 'deliver-early')", name="ck_backlog_cap_policy"),
)

stored_count = Table(
    "stored_count",
    metadata,
    # one row: messages stored with an id up to `watermark` (settled: no transaction that drew
    # such an id can still commit); `candidate` the next watermark once the transactions in
    # `candidate_waits_for` (virtual xids) have ended (`store.settle_stored`)
    Column("id", SmallInteger, primary_key=True),
    Column("counted", BigInteger, nullable=False),
    Column("watermark", BigInteger, nullable=False),
    Column("candidate", BigInteger),
    Column("candidate_waits_for", ARRAY(Text)),
    CheckConstraint("id = 1", name="ck_stored_count_one_row"),
)

api_token = Table(
    "api_token",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", Text, nullable=False, unique=True),
    Column("token_hash", Text, nullable=False, unique=True),
    Column("scope", Text, nullable=False),
    Column("created_at", Timestamp, nullable=False, server_default=text("now()")),
    Column("revoked_at", Timestamp),
    Column("topics", ARRAY(Text)),
    Column("expires_at", Timestamp),  # NULL: never
    CheckConstraint("scope IN ('send', 'admin')", name="ck_api_token_scope"),
)

dashboard_user = Table(
    "dashboard_user",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", Text, nullable=False, unique=True),
    Column("password_hash", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("created_at", Timestamp, nullable=False, server_default=text("now()")),
    Column("failed_logins", Integer, nullable=False, server_default=text("0")),
    Column("locked_until", Timestamp),
    # the generation of the user's dashboard sessions: a session cookie carries the one it was
    # made in and is no session once this moves on (logout and every password set bump it)
    Column("session_generation", Integer, nullable=False, server_default=text("0")),
    CheckConstraint("role IN ('admin', 'viewer')", name="ck_dashboard_user_role"),
)

# A client's failed dashboard logins in a fixed window (`delaysvc.auth.check_login`); a client
# is an IPv4 address or an IPv6 /64. Rows whose window ended are pruned by later failures.
login_client = Table(
    "login_client",
    metadata,
    Column("client", Text, primary_key=True),
    Column("failures", Integer, nullable=False),
    Column("window_ends", Timestamp, nullable=False),
    Index("ix_login_client_window_ends", "window_ends"),
)

# ---------------------------------------------------------------- history (small, not hot)

LATENESS_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 60000)
"""Upper bounds of the lateness histogram's buckets; one more bucket counts the rest."""

stats_sample = Table(
    "stats_sample",
    metadata,
    Column("sampled_at", Timestamp, primary_key=True),
    Column("lane", SmallInteger, primary_key=True, autoincrement=False),
    Column("pending", BigInteger, nullable=False),
    Column("moved_total", BigInteger, nullable=False),
    Column("early_total", BigInteger, nullable=False),
    Column("head_lateness_ms", Float),
)

lateness_histogram = Table(
    "lateness_histogram",
    metadata,
    Column("minute", Timestamp, primary_key=True),
    Column("lane", SmallInteger, primary_key=True, autoincrement=False),
    Column("counts", ARRAY(BigInteger), nullable=False),
    Column("max_ms", Float, nullable=False),
)

DURATION_BUCKETS_MS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
"""Upper bounds of the handler-duration histogram's buckets; one more counts the rest."""

handler_duration_histogram = Table(
    "handler_duration_histogram",
    metadata,
    Column("minute", Timestamp, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("counts", ARRAY(BigInteger), nullable=False),
    Column("max_ms", Float, nullable=False),
)

# Running totals since the database was created, per lane and per topic: what `GET /metrics`
# exposes as Prometheus histograms and counters. The minute rows above are pruned after a week
# (the dashboard reads them); these rows only ever grow, so a scrape never sees a bucket, a sum
# or a counter go down. Each is written in the statement that adds to its key's minute row, by
# the writers that already hold that row's lock: no new point of contention. Sums are in ms.
lateness_total = Table(
    "lateness_total",
    metadata,
    Column("lane", SmallInteger, primary_key=True, autoincrement=False),
    Column("counts", ARRAY(BigInteger), nullable=False),
    Column("sum_ms", Float, nullable=False, server_default=text("0")),
    postgresql_with={"fillfactor": "50"},
)

topic_total = Table(
    "topic_total",
    metadata,
    Column("topic", Text, primary_key=True),
    Column("duration_counts", ARRAY(BigInteger), nullable=False, server_default=text("'{}'")),
    Column("duration_sum_ms", Float, nullable=False, server_default=text("0")),
    Column("succeeded", BigInteger, nullable=False, server_default=text("0")),
    Column("retried", BigInteger, nullable=False, server_default=text("0")),
    Column("dead", BigInteger, nullable=False, server_default=text("0")),
    postgresql_with={"fillfactor": "50"},
)

heartbeat = Table(
    "heartbeat",
    metadata,
    Column("component", Text, primary_key=True),
    Column("seen_at", Timestamp, nullable=False),
    Column("host", Text),
    postgresql_with={"fillfactor": "50"},
)

pipeline_run = Table(
    "pipeline_run",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("kind", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'running'")),
    Column("started_at", Timestamp, nullable=False, server_default=text("now()")),
    Column("finished_at", Timestamp),
    Column("params", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("range_from_id", BigInteger),
    Column("range_to_id", BigInteger),
    Column("rows_read", BigInteger),
    Column("rows_written", BigInteger),
    Column("rows_rejected", BigInteger),
    Column("checksum", Text),
    Column("output_path", Text),
    Column("error", Text),
    CheckConstraint("kind IN ('archive', 'report', 'bulk-schedule')", name="ck_pipeline_run_kind"),
    CheckConstraint("status IN ('running', 'succeeded', 'failed')", name="ck_pipeline_run_status"),
)

report_hourly = Table(
    "report_hourly",
    metadata,
    Column("hour", Timestamp, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("level", SmallInteger, primary_key=True, autoincrement=False),
    Column("messages", BigInteger, nullable=False),
    Column("lateness_p50_ms", Float),
    Column("lateness_p95_ms", Float),
    Column("lateness_p99_ms", Float),
    Column("lateness_max_ms", Float),
    Column("duration_p50_ms", Float),
    Column("duration_p95_ms", Float),
    Column("duration_p99_ms", Float),
    Column("retried", BigInteger, nullable=False, server_default=text("0")),
    Column("dead", BigInteger, nullable=False, server_default=text("0")),
    Column("run_id", BigInteger),
)


# A bulk-schedule run's stored batches (`delaysvc.pipeline.bulk`): one row per batch, written
# in the batch's own transaction, so a Spark task run again (its executor lost, a speculative
# copy) finds the batches an earlier attempt committed and stores them no second time.
bulk_batch = Table(
    "bulk_batch",
    metadata,
    Column("run", Text, primary_key=True),
    Column("first_rid", BigInteger, primary_key=True, autoincrement=False),
    Column("last_rid", BigInteger, nullable=False),
    Column("rows", Integer, nullable=False),
    Column("created", Integer),
    Column("stored_at", Timestamp, nullable=False, server_default=text("now()")),
)

# Periodic schedules (`delaysvc.maintenance.periodic`): one row per schedule; `next_tick` is the
# next tick not yet fired, advanced in the transaction that stores the tick's message, so each
# tick is one message however many beats run.
periodic_schedule = Table(
    "periodic_schedule",
    metadata,
    Column("name", Text, primary_key=True),
    Column("topic", Text, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("body_is_json", Boolean, nullable=False),
    Column("cron", Text),
    Column("every_ms", BigInteger),
    Column("timezone", Text, nullable=False, server_default=text("'UTC'")),
    Column("on_missed", Text, nullable=False, server_default=text("'skip'")),
    Column("declared_in", Text, nullable=False),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    Column("next_tick", Timestamp, nullable=False),
    Column("last_tick", Timestamp),
    Column("last_message_id", BigInteger),
    Column("created_at", Timestamp, nullable=False, server_default=text("now()")),
    Column("updated_at", Timestamp, nullable=False, server_default=text("now()")),
    # code-declared: when and by which worker last declared (removed when none has for a while)
    Column("declared_at", Timestamp),
    Column("declared_by", Text),
    CheckConstraint("(cron IS NULL) <> (every_ms IS NULL)", name="ck_periodic_schedule_spec"),
    CheckConstraint("on_missed IN ('skip', 'latest')", name="ck_periodic_schedule_on_missed"),
    CheckConstraint("declared_in IN ('code', 'api')", name="ck_periodic_schedule_declared_in"),
    CheckConstraint(
        "(declared_in = 'code') = (declared_at IS NOT NULL)",
        name="ck_periodic_schedule_declared_at",
    ),
    Index("ix_periodic_schedule_next_tick", "next_tick", postgresql_where=text("NOT paused")),
)

# Celery tasks revoked through `delaysvc.contrib.celery` (`app.control.revoke`): a message of
# the task that comes due is dropped, not published, whenever it was stored (a retry the
# running task stores after its revoke; one no lookup of the revoke found). Kept for the
# longest delay and a day after the revoke, pruned by later revokes (`revoked_at`).
celery_revoked = Table(
    "celery_revoked",
    metadata,
    Column("task_id", Text, primary_key=True),
    Column("revoked_at", Timestamp, nullable=False, server_default=text("now()")),
    Index("ix_celery_revoked_revoked_at", "revoked_at"),
)

# Celery stamps revoked (`revoke_by_stamped_headers`): a stored task carrying one is dropped when
# due. `value` is the stamp's value as JSON (`1` and `"1"` are other stamps, as in Celery). Kept
# and pruned as `celery_revoked`.
celery_revoked_stamp = Table(
    "celery_revoked_stamp",
    metadata,
    Column("header", Text, primary_key=True),
    Column("value", Text, primary_key=True),
    Column("revoked_at", Timestamp, nullable=False, server_default=text("now()")),
    Index("ix_celery_revoked_stamp_revoked_at", "revoked_at"),
)

SEQUENCES = (timer_queue_seq, topic_queue_seq, claim_seq)


def lane_name(lane: int) -> str:
    """A lane as users read it: `timer` (0) or `level-N`."""
    return "timer" if lane == TIMER_LANE else f"level-{lane}"


def level_partition(level: int) -> str:
    return f"consume_queue_{int(level)}"


def level_sequence(level: int) -> str:
    return f"consume_queue_{int(level)}_seq"


def is_level_partition(name: str) -> bool:
    prefix = "consume_queue_"
    return name.startswith(prefix) and name[len(prefix) :].isdigit()


def history_partition(day: date) -> str:
    return f"message_history_{day:%Y%m%d}"


def is_history_partition(name: str) -> bool:
    prefix = "message_history_"
    return name.startswith(prefix) and name[len(prefix) :].isdigit()
