"""A message that cannot be moved into its topic's queue: a trigger refuses its row there, as
a bug, a constraint or a corrupted row would (the delivery's "a row that cannot be moved")."""

from __future__ import annotations

from sqlalchemy import Engine, text


def make_unmovable(engine: Engine, message_id: int) -> None:
    """From now on, inserting `message_id` into `topic_queue` raises `refused`."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF NEW.message_id = {int(message_id)} THEN RAISE EXCEPTION 'refused'; END IF; "
                "RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE INSERT ON topic_queue "
                "FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )
