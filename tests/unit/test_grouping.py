"""Group commit's coordination (`delaysvc.producer.grouping`), with writers that record what
they were given; the database side is tests/integration/test_group_commit.py."""

import os
import signal
import threading
import time

import pytest

from delaysvc.producer import grouping


class Writes:
    """`write_one` and `write_group` for a `Grouped`, recording their calls; `hold` keeps the
    next write from finishing until `release`."""

    def __init__(self):
        self.calls: list[tuple[str, list[str]]] = []
        self.started = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self.refuse: set[str] = set()  # messages write_group does not store
        self.fail: Exception | None = None

    def hold(self):
        self._go.clear()
        self.started.clear()

    def release(self):
        self._go.set()

    def one(self, message: str) -> str:
        self.calls.append(("one", [message]))
        self.started.set()
        self._go.wait(10)
        return f"{message}: alone"

    def group(self, messages):
        self.calls.append(("group", list(messages)))
        if self.fail is not None:
            raise self.fail
        return [
            None if m in self.refuse else f"{m}: in a group of {len(messages)}" for m in messages
        ]


def queued(grouped: grouping.Grouped, count: int) -> None:
    """Wait until `count` writes wait behind the one under way."""
    deadline = time.monotonic() + 10
    while len(grouped._waiting) < count:
        assert time.monotonic() < deadline, f"{len(grouped._waiting)} of {count} waiting"
        time.sleep(0.001)


def in_threads(
    grouped: grouping.Grouped, messages: list[str], results: dict | None = None
) -> tuple[dict, list[threading.Thread]]:
    """Each message written by a thread of its own; -> (message -> its result or error, the
    threads)."""
    results = {} if results is None else results

    def send(message: str) -> None:
        try:
            results[message] = grouped.write(message)
        except Exception as exc:  # the test reads it
            results[message] = exc

    threads = [threading.Thread(target=send, args=(m,)) for m in messages]
    for thread in threads:
        thread.start()
    return results, threads


def held_first(grouped: grouping.Grouped, writes: Writes) -> list[threading.Thread]:
    """A first write (from a thread of its own) under way and held. -> its thread."""
    writes.hold()
    _, first = in_threads(grouped, ["first"])
    assert writes.started.wait(10)
    return first


def behind_a_first(grouped: grouping.Grouped, writes: Writes, messages: list[str]) -> dict:
    """A first write held until `messages` (each from a thread of its own, all at once) wait
    behind it, then let go. -> message -> its result or error."""
    first = held_first(grouped, writes)
    results, threads = in_threads(grouped, messages)
    queued(grouped, len(messages))
    writes.release()
    for thread in first + threads:
        thread.join(10)
    return results


def test_a_write_with_none_under_way_is_written_alone_at_once():
    writes = Writes()
    grouped = grouping.Grouped(writes.one, writes.group, 1)
    assert grouped.write("a") == "a: alone"
    assert grouped.write("b") == "b: alone"
    assert writes.calls == [("one", ["a"]), ("one", ["b"])]


def test_writes_that_wait_behind_one_are_written_together_in_order():
    writes = Writes()
    grouped = grouping.Grouped(writes.one, writes.group, 1)
    first_threads = held_first(grouped, writes)
    results: dict[str, object] = {}
    threads: list[threading.Thread] = []
    for message in ["b", "c", "d"]:  # one at a time, so their order is known
        threads += in_threads(grouped, [message], results)[1]
        queued(grouped, len(threads))
    writes.release()
    for thread in first_threads + threads:
        thread.join(10)
    assert writes.calls == [("one", ["first"]), ("group", ["b", "c", "d"])]
    assert results == {m: f"{m}: in a group of 3" for m in "bcd"}


def test_each_waiting_write_gets_its_own_result_and_one_not_stored_is_written_alone():
    writes = Writes()
    writes.refuse = {"c"}
    grouped = grouping.Grouped(writes.one, writes.group, 1)
    results = behind_a_first(grouped, writes, ["b", "c", "d"])
    assert results == {
        "b": "b: in a group of 3",
        "c": "c: alone",
        "d": "d: in a group of 3",
    }
    assert ("one", ["c"]) in writes.calls


def test_a_group_of_one_is_written_as_one():
    writes = Writes()
    grouped = grouping.Grouped(writes.one, writes.group, 1)
    results = behind_a_first(grouped, writes, ["b"])
    assert results == {"b": "b: alone"}
    assert [kind for kind, _ in writes.calls] == ["one", "one"]


def test_a_failed_group_fails_every_write_in_it_each_with_its_own_error():
    writes = Writes()
    writes.fail = ConnectionError("the database went away")
    grouped = grouping.Grouped(writes.one, writes.group, 1)
    results = behind_a_first(grouped, writes, ["b", "c", "d"])
    errors = [results[m] for m in "bcd"]
    assert all(isinstance(e, ConnectionError) for e in errors), errors
    assert all(str(e) == "the database went away" for e in errors)
    assert len({id(e) for e in errors}) == 3  # no two threads raised the same object
    # and writing goes on
    writes.fail = None
    assert grouped.write("e") == "e: alone"


def test_more_waiting_than_a_group_takes_go_in_the_next(monkeypatch):
    monkeypatch.setattr(grouping, "MOST", 2)
    writes = Writes()
    grouped = grouping.Grouped(writes.one, writes.group, 1)
    results = behind_a_first(grouped, writes, ["b", "c", "d", "e", "f"])
    assert sorted(len(messages) for kind, messages in writes.calls[1:]) == [1, 2, 2]
    assert len(results) == 5 and all(isinstance(r, str) for r in results.values())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_the_parent_writes_does_not_wait_for_it():
    writes = Writes()
    grouped = grouping.Grouped(writes.one, writes.group, 1)
    first = held_first(grouped, writes)
    pid = os.fork()
    if pid == 0:  # the child: its copy of the parent's write will never end
        signal.alarm(10)  # a child left waiting for it ends here, failing the test
        try:
            writes.release()  # the child's own writes finish
            os._exit(0 if grouped.write("child") == "child: alone" else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    writes.release()
    for thread in first:
        thread.join(10)
    assert os.waitstatus_to_exitcode(status) == 0


def test_with_two_writers_a_second_write_goes_at_once_and_a_third_waits():
    writes = Writes()
    grouped = grouping.Grouped(writes.one, writes.group, 2)
    first = held_first(grouped, writes)
    writes.started.clear()
    _, second = in_threads(grouped, ["second"])
    assert writes.started.wait(10)  # written alone beside the first
    results, threads = in_threads(grouped, ["b", "c"])
    queued(grouped, 2)
    writes.release()
    for thread in first + second + threads:
        thread.join(10)
    assert writes.calls[:2] == [("one", ["first"]), ("one", ["second"])]
    assert writes.calls[2] == ("group", ["b", "c"])
    assert results == {"b": "b: in a group of 2", "c": "c: in a group of 2"}
