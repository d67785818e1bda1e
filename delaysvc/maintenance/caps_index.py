"""The index of the capped topics' waiting messages, kept in step with the topic caps.

A topic cap counts its topic's waiting messages and delivers the oldest early through an index
of (topic, deliver_ts). Until migration 0020 that index held every waiting message of every
topic, so every send paid for it, capped or not: a fifth of a batch's COPY into the commit log
(docs/benchmarks/2026-11-27-batch-write-costs). Now its predicate names the capped topics
(`store.capped_index_for`): a send to any other topic writes nothing into it. When the caps
change, `run_once` builds the index that fits them CONCURRENTLY, so no send waits, and drops the
others. The counts never depend on it: without it (a cap set a moment ago, a cap only in a
producer's DELAYSVC_BACKLOG_CAPS) they are the same, read by scanning the commit log instead.

It runs at `delaysvc migrate`, when a delivery worker starts and every minute in each delivery
worker (`delaysvc.tasks.periodic`), and after the CLI sets or lifts a topic cap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import Engine

from delaysvc import store

log = logging.getLogger(__name__)


@dataclass
class Indexed:
    """What one round did: the capped topics it read, the index it built (None: none needed
    building), the indexes it dropped."""

    topics: list[str]
    built: str | None = None
    dropped: list[str] = field(default_factory=list)


def run_once(engine: Engine) -> Indexed:
    """Build the index the topic caps need if it is missing, and drop any other; -> what was
    done. CREATE INDEX CONCURRENTLY waits for the transactions older than it to end: a caller
    with a transaction of its own open on the same database must not wait for this."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        done = Indexed(store.capped_topics(conn))
        wanted = store.capped_index_for(done.topics)
        present = {index.name: index for index in store.capped_indexes(conn)}
        if wanted is not None:
            name, topics = wanted
            found = present.pop(name, None)
            if found is not None and not found.valid and not found.building:  # a failed build
                store.drop_capped_index(conn, name)
                found = None
            if found is None:
                store.build_capped_index(conn, name, topics)
                done.built = name
        for name in present:
            store.drop_capped_index(conn, name)
            done.dropped.append(name)
    if done.built or done.dropped:
        log.info(
            "caps.indexed",
            extra={"topics": len(done.topics), "built": done.built, "dropped": done.dropped},
        )
    return done
