"""The connections a producer keeps for its single sends (`delaysvc.db.held`): reused, at most
`most` of them beside the engine's pool, closed with the engine, never shared with a forked
child. (A kept connection the server closed is replaced before use, and one lost mid-send says
the send may be stored: tests/integration/test_unavailable.py.)"""

from __future__ import annotations

import gc
import os

from sqlalchemy import Engine, text

from delaysvc.db.held import HeldConnections
from delaysvc.producer.sending import Producer


def _backends(engine: Engine) -> set[int]:
    """The pids of this database's other backends."""
    with engine.connect() as conn:
        return set(
            conn.scalars(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()"
                )
            )
        )


def test_kept_connections_are_reused_at_most_most_beside_the_pool(engine: Engine) -> None:
    held = HeldConnections(engine, most=2)
    with held.cursor() as a, held.cursor() as b, held.cursor() as c:
        pids = [cursor.connection.info.backend_pid for cursor in (a, b, c)]
        assert len(set(pids)) == 3
        assert all(cursor.connection.autocommit for cursor in (a, b, c))
        assert engine.pool.checkedout() == 1  # the third, over `most`, is the pool's
    with held.cursor() as again:  # the last kept one given back (a's: c, b, a) is taken first
        assert again.connection.info.backend_pid == pids[0]
        assert again.execute("SELECT 1").fetchone() == (1,)
    assert engine.pool.checkedout() == 0
    engine.dispose()  # closes the kept ones no send is using
    assert not set(pids[:2]) & _backends(engine)


def test_a_failed_statement_leaves_its_kept_connection_usable(engine: Engine) -> None:
    held = HeldConnections(engine, most=1)
    try:
        with held.cursor() as cursor:
            pid = cursor.connection.info.backend_pid
            cursor.execute("SELECT 1 / 0")
    except Exception as exc:
        assert "division by zero" in str(exc)
    with held.cursor() as cursor:  # autocommit: nothing of the failure is left on it
        assert cursor.connection.info.backend_pid == pid
        assert cursor.execute("SELECT 2").fetchone() == (2,)


def test_a_forked_child_never_uses_or_closes_its_parents_connection(
    producer: Producer, engine: Engine
) -> None:
    sent = producer.send("held.fork", {"n": 0})
    with producer._held.cursor() as cursor:
        parent_pid = cursor.connection.info.backend_pid
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: send, then drop the producer as a process ending would
        code = 1
        try:
            producer.send("held.fork", {"n": 1})
            with producer._held.cursor() as cursor:
                os.write(write, str(cursor.connection.info.backend_pid).encode())
            producer._held.close_free()
            del cursor
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    child_backend = int(os.read(read, 64) or b"0")
    os.close(read)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_backend not in (0, parent_pid)  # the child opened one of its own
    # the parent's connection lived through the child's send and end: still kept, still open
    again = producer.send("held.fork", {"n": 2})
    with producer._held.cursor() as cursor:
        assert cursor.connection.info.backend_pid == parent_pid
    with engine.connect() as conn:
        topics = conn.execute(
            text("SELECT count(*) FROM commit_log WHERE topic = 'held.fork'")
        ).scalar_one()
    assert topics == 3 and again.id > sent.id
