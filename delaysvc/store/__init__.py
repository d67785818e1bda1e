"""Every statement the service runs, each named for what it does.

Callers pass a SQLAlchemy `Connection` and own the transaction; nothing here commits. The
producer's statements (sending, cancelling, reading a message, the backlog caps) take any
`Statements`: a SQLAlchemy `Connection`, or a connection the caller holds adapted by
`delaysvc.db.connections` (psycopg 3, psycopg2, Django's, asyncio ones), so they join any
transaction the caller has open. "Now" is the database clock (`statement_timestamp()`) unless a test
passes `now=`.

Lanes (see `delaysvc.schema`): a waiting message sits in lane N >= 1 (consume queue of level N,
FIFO by offset) or lane 0 (the timer lane, by deliver_ts); lane -1 means it is in its topic's
queue (or beyond). `_PLACED_LANE`, `_NEXT_OFFSET` and `_ENQUEUE_FROM` are the pieces every write
that puts a message into a lane shares (send, batch send, retry, bulk schedule).

The database is the one truth for a level's delay (`schedule_offset.delay_ms`): a message goes
into a level's FIFO queue only if its delay is that level's delay in the database, else into the
timer lane at the same due time, so a producer or a worker whose DELAYSVC_DELAY_LEVELS drifted
from the database can never make a level's offset order differ from its due order. Every write
that adds messages to a lane or takes them out appends their count to `lane_count` in the same
statement: the backlog figures and the level caps read exact counts, not offsets.

One module per family of statements: `shared` (what they all share), `levels`, `producing`,
`cancelling`, `delivery`, `consuming`, `dead_letters`, `caps`, `health`, `totals`, `observing`,
`users`; this package re-exports their public names (`store.claim_ready(...)`). The families
with a reader of their own are imported as modules: `history` (the finished messages' history),
`schedules` (periodic schedules), `tokens` (API tokens), `dashboard` (the dashboard's bounded
reads) and `check` (`delaysvc check`'s invariants).
"""

from delaysvc.store.cancelling import (
    due_before,
    mark_cancelled,
    note_replaced,
    take_out_of_lane,
    take_out_of_topic_queue,
)
from delaysvc.store.caps import (
    backlog_caps,
    caps_covering,
    deliver_now,
    fold_lane_counts,
    lane_pending,
    lift_backlog_cap,
    lock_cap,
    lock_key_holders,
    oldest_waiting_in_level,
    oldest_waiting_of_topic,
    set_backlog_cap,
    topic_pending,
)
from delaysvc.store.consuming import (
    Failure,
    bury,
    claim_ready,
    claim_statement,
    distinct_topics,
    finish_one_succeeded,
    finish_succeeded,
    lock_limits,
    release_unstarted,
    renew_leases,
    rescue_expired_leases,
    running_job,
    schedule_retry,
    set_limits,
    set_topic_paused,
    spend_tokens,
    start_jobs,
    topic_limits,
    topics_with_ready,
)
from delaysvc.store.dead_letters import (
    dead_ids,
    list_dead,
    purge_dead,
    redrive_dead,
)
from delaysvc.store.delivery import (
    CLOCK_MARGIN_MS,
    Moved,
    Relocated,
    clock_now,
    lane_head,
    lock_lane,
    mark_stuck,
    move_due,
    relocate_misplaced,
    skip_stuck_head,
)
from delaysvc.store.health import (
    HANDLER_HEARTBEAT_SECONDS,
    HANDLER_STALE_AFTER_SECONDS,
    heartbeats,
    recent_durations,
    record_handlers,
    record_heartbeat,
    slowest_lane_heartbeat,
    unhandled_ready,
)
from delaysvc.store.levels import (
    LEVEL_CHANGE_LOCK_TIMEOUT,
    LevelChange,
    check_levels,
    ensure_levels,
    relocate_to_timer,
    stored_levels,
)
from delaysvc.store.observing import (
    lane_stats,
    topic_stats,
    unique_violation,
)
from delaysvc.store.producing import (
    INSERT_STAGED,
    Stored,
    find_message_by_key,
    find_unfinished_by_key,
    find_unfinished_by_keys,
    get_message,
    insert_message,
    insert_message_on,
    insert_messages,
    insert_uncapped_on,
    stage_row,
    stage_rows,
)
from delaysvc.store.shared import (
    DELIVERED_AT,
    IN_TOPIC_QUEUE,
    LANE,
    MESSAGE_COLUMNS,
    MESSAGE_STATE,
    MOVED,
    NOT_MOVED,
    NOW,
    STATUS,
    WAITING,
    NewMessage,
    Statements,
)
from delaysvc.store.totals import (
    MINUTES_KEPT,
    OutcomeCounts,
    add_durations,
    add_lateness,
    add_outcomes,
    lateness_totals,
    messages_stored,
    settle_stored,
    topic_totals,
)
from delaysvc.store.users import (
    clear_failed_logins,
    count_login_attempt,
    find_user,
    upsert_user,
)

__all__ = [
    "CLOCK_MARGIN_MS",
    "DELIVERED_AT",
    "HANDLER_HEARTBEAT_SECONDS",
    "HANDLER_STALE_AFTER_SECONDS",
    "INSERT_STAGED",
    "IN_TOPIC_QUEUE",
    "LANE",
    "LEVEL_CHANGE_LOCK_TIMEOUT",
    "MESSAGE_COLUMNS",
    "MESSAGE_STATE",
    "MINUTES_KEPT",
    "MOVED",
    "NOT_MOVED",
    "NOW",
    "STATUS",
    "WAITING",
    "Failure",
    "LevelChange",
    "Moved",
    "NewMessage",
    "OutcomeCounts",
    "Relocated",
    "Statements",
    "Stored",
    "add_durations",
    "add_lateness",
    "add_outcomes",
    "backlog_caps",
    "bury",
    "caps_covering",
    "check_levels",
    "claim_ready",
    "claim_statement",
    "clear_failed_logins",
    "clock_now",
    "count_login_attempt",
    "dead_ids",
    "deliver_now",
    "distinct_topics",
    "due_before",
    "ensure_levels",
    "find_message_by_key",
    "find_unfinished_by_key",
    "find_unfinished_by_keys",
    "find_user",
    "finish_one_succeeded",
    "finish_succeeded",
    "fold_lane_counts",
    "get_message",
    "heartbeats",
    "insert_message",
    "insert_message_on",
    "insert_messages",
    "insert_uncapped_on",
    "lane_head",
    "lane_pending",
    "lane_stats",
    "lateness_totals",
    "lift_backlog_cap",
    "list_dead",
    "lock_cap",
    "lock_key_holders",
    "lock_lane",
    "lock_limits",
    "mark_cancelled",
    "mark_stuck",
    "messages_stored",
    "move_due",
    "note_replaced",
    "oldest_waiting_in_level",
    "oldest_waiting_of_topic",
    "purge_dead",
    "recent_durations",
    "record_handlers",
    "record_heartbeat",
    "redrive_dead",
    "release_unstarted",
    "relocate_misplaced",
    "relocate_to_timer",
    "renew_leases",
    "rescue_expired_leases",
    "running_job",
    "schedule_retry",
    "set_backlog_cap",
    "set_limits",
    "set_topic_paused",
    "settle_stored",
    "skip_stuck_head",
    "slowest_lane_heartbeat",
    "spend_tokens",
    "stage_row",
    "stage_rows",
    "start_jobs",
    "stored_levels",
    "take_out_of_lane",
    "take_out_of_topic_queue",
    "topic_limits",
    "topic_pending",
    "topic_stats",
    "topic_totals",
    "topics_with_ready",
    "unhandled_ready",
    "unique_violation",
    "upsert_user",
]
