"""What `send_batch` returns (`SentBatch`): a Message per item made the first time it is read,
read as a list is read."""

import copy
import gc
import pickle
import sys
import threading
import weakref
from datetime import UTC, datetime

import pytest

from delaysvc.producer.message import Message, SentBatch

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


class _Items:
    """What a batch's maker holds (its items), to see when the batch lets it go."""


def _batch(n: int) -> tuple[SentBatch, list[int], _Items]:
    made: list[int] = []
    items = _Items()

    def make(index: int, items: _Items = items) -> Message:
        made.append(index)
        return Message(index * 10, "t", None, "scheduled", 1, NOW, NOW)

    return SentBatch([i * 10 for i in range(n)], make), made, items


def test_a_message_is_made_when_first_read_and_kept() -> None:
    batch, made, _ = _batch(4)
    assert batch.ids == [0, 10, 20, 30] and made == []  # ids without a Message made
    assert batch[2].id == 20 and batch[-1].id == 30 and made == [2, 3]
    assert batch[2] is batch[2] and batch[-2] is batch[2] and made == [2, 3]
    assert [m.id for m in batch[1:3]] == [10, 20] and made == [2, 3, 1]
    assert len(batch) == 4 and made == [2, 3, 1]


def test_it_reads_as_a_list_of_its_messages() -> None:
    batch, _, _ = _batch(3)
    messages = [Message(i * 10, "t", None, "scheduled", 1, NOW, NOW) for i in range(3)]
    assert batch == messages and messages == batch and batch != messages[:2]
    assert batch != tuple(messages)  # as a list is not equal to a tuple
    assert [m.id for m in batch] == [0, 10, 20] and next(reversed(batch)).id == 20
    assert batch + messages[:1] == [*messages, messages[0]]
    assert messages[:1] + batch == [messages[0], *messages]
    assert messages[1] in batch and batch.index(messages[2]) == 2
    assert "Message(id=10" in repr(batch)
    with pytest.raises(IndexError):
        batch[3]
    with pytest.raises(IndexError):
        batch[-4]
    with pytest.raises(TypeError):
        hash(batch)


def test_once_every_message_is_made_the_batch_lets_its_items_go() -> None:
    batch, _, items = _batch(3)
    held = weakref.ref(items)
    del items
    batch[0], batch[1]
    gc.collect()
    assert held() is not None  # one still to make
    batch[2]
    gc.collect()
    assert held() is None
    assert [m.id for m in batch] == [0, 10, 20]


def test_a_batch_made_from_messages_already_made() -> None:
    messages = [Message(i, "t", None, "ready", None, NOW, NOW) for i in (5, 6)]
    batch = SentBatch.of(messages)
    assert batch.ids == [5, 6] and batch[1] is messages[1] and batch == messages
    assert SentBatch.of([]) == [] and len(SentBatch.of([])) == 0


def test_it_pickles_and_copies_as_its_messages() -> None:
    batch, _, _ = _batch(3)
    for again in (pickle.loads(pickle.dumps(batch)), copy.copy(batch), copy.deepcopy(batch)):
        assert isinstance(again, SentBatch) and again == batch and again.ids == batch.ids


def _read_at_once(batch: SentBatch, start: threading.Barrier, read: list[list[Message]]) -> None:
    start.wait()
    read.append(list(batch))


def test_threads_reading_it_at_once_each_read_every_message_the_same() -> None:
    """Reads race on a Message not yet made: each is made once and every thread gets it."""
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps of a read
    try:
        for _ in range(5):
            batch, made, _ = _batch(2000)
            start = threading.Barrier(4)
            read: list[list[Message]] = []
            threads = [
                threading.Thread(target=_read_at_once, args=(batch, start, read)) for _ in range(4)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(read) == 4 and sorted(made) == list(range(2000))
            assert all(all(a is b for a, b in zip(read[0], other, strict=True)) for other in read)
    finally:
        sys.setswitchinterval(switching)
