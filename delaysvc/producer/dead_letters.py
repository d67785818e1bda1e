"""Dead letters: list, inspect, redrive (one or all matching) and purge."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import IntegrityError

from delaysvc import store
from delaysvc.config.validation import validate_topic
from delaysvc.errors import DuplicateKey, NotFound
from delaysvc.producer.sending import Message

log = logging.getLogger(__name__)
BATCH = 500


class DeadLetters:
    def __init__(self, engine: Engine):
        self.engine = engine

    def list(
        self,
        topic: str | None = None,
        after_id: int | None = None,
        limit: int = 100,
        *,
        topics: Collection[str] | None = None,
    ) -> list[Any]:
        """Newest first, after `after_id`; of `topic` if given. `topics` (an API token's):
        only letters of these topics."""
        if topic is not None:
            validate_topic(topic)
        if topics is None:
            with self.engine.connect() as conn:
                return store.list_dead(conn, topic, after_id, limit)
        # a page per allowed topic (the asked one, if allowed), merged: a token has few topics
        wanted = [t for t in sorted(topics) if topic in (None, t)]
        with self.engine.connect() as conn:
            rows = [row for t in wanted for row in store.list_dead(conn, t, after_id, limit)]
        return sorted(rows, key=lambda row: row.message_id, reverse=True)[:limit]

    def redrive(self, message_id: int, *, topics: Collection[str] | None = None) -> Message:
        """Run a dead message again now with a fresh retry budget. `topics` (an API token's):
        a letter of any other topic is NotFound, as if it were none."""
        return self.redrive_all([message_id], topics=topics)[0]

    def redrive_all(
        self, message_ids: Sequence[int], *, topics: Collection[str] | None = None
    ) -> Sequence[Message]:
        """Redrive every one of `message_ids` in one transaction, or none of them: an id that
        is no dead letter (or one whose key a newer message holds) fails the whole call."""
        ids = list(dict.fromkeys(message_ids))
        none = "; none was redriven" if len(ids) > 1 else ""
        rows, current = [], None
        try:
            with self.engine.begin() as conn:
                for current in ids:
                    hidden = topics is not None and _topic_of(conn, current) not in topics
                    row = None if hidden else store.redrive_dead(conn, current)
                    if row is None:
                        raise NotFound(f"message {current} is not a dead letter{none}")
                    rows.append(row)
        except IntegrityError as exc:
            if store.unique_violation(exc, "uq_commit_log_topic_key"):
                raise DuplicateKey(
                    f"message {current}: its key is held by a newer unfinished message{none}"
                ) from None
            raise
        for message_id in ids:
            log.info("dead.redriven", extra={"message_id": message_id})
        return [Message.from_row(row) for row in rows]

    def redrive_matching(self, topic: str | None = None, error_contains: str | None = None) -> int:
        """Redrive every dead letter matching the filter, in bounded batches; letters whose key
        is taken by a newer message stay dead. -> how many were redriven."""
        done, skipped = 0, set[int]()
        while True:
            with self.engine.connect() as conn:
                ids = [
                    i
                    for i in store.dead_ids(conn, topic, error_contains, BATCH + len(skipped))
                    if i not in skipped
                ]
            if not ids:
                return done
            for message_id in ids:
                try:
                    self.redrive(message_id)
                    done += 1
                except (DuplicateKey, NotFound):
                    skipped.add(message_id)

    def purge(self, message_ids: Sequence[int]) -> int:
        with self.engine.begin() as conn:
            return store.purge_dead(conn, message_ids)

    def purge_matching(self, topic: str | None = None, error_contains: str | None = None) -> int:
        total = 0
        while True:
            with self.engine.begin() as conn:
                ids = store.dead_ids(conn, topic, error_contains, BATCH)
                if not ids:
                    return total
                total += store.purge_dead(conn, ids)


def _topic_of(conn: Connection, message_id: int) -> str | None:
    found = store.get_message(conn, message_id)
    return None if found is None else str(found.topic)
