"""The request bodies of the HTTP API as types, with the error and the few answers the views
build themselves; the other answers' types are `delaysvc.serialize`'s.

`delaysvc.web.openapi` generates the document's schemas from these types (through pydantic),
and every limit they state is the constant the checks use (`delaysvc.config.validation`, the
producer, the caps, the schedules): the document cannot promise other limits than the checks
keep. The bodies are not validated through these types: the checks' own errors name the field
and what it takes (400 `invalid`), and `delaysvc.send` runs the same checks in Python. A test
(tests/unit/test_openapi_limits.py) holds the schemas and the checks to one verdict at each
limit.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, NotRequired

from pydantic import ConfigDict, Field, StringConstraints, with_config
from typing_extensions import TypedDict  # pydantic's TypedDicts, before Python 3.12

from delaysvc.config.levels import DURATION_PATTERN
from delaysvc.config.settings import CapPolicy
from delaysvc.config.validation import (
    CONTROL_CHARS,
    MAX_KEY_CHARS,
    MAX_PRIORITY,
    MAX_PROPERTIES,
    MAX_PROPERTY_NAME,
    MAX_PROPERTY_VALUE,
    MAX_RATE_PER_S,
    MAX_RUNNING,
    MAX_TAGS,
    MIN_RATE_PER_S,
    RATE_PATTERN,
    TAG_PATTERN,
    TOPIC_PATTERN,
)
from delaysvc.maintenance.periodic import MAX_BODY_BYTES as MAX_SCHEDULE_BODY_BYTES
from delaysvc.maintenance.periodic import NAME as SCHEDULE_NAME_PATTERN
from delaysvc.maintenance.periodic import OnMissed
from delaysvc.producer.caps import MAX_WAITING
from delaysvc.producer.sending import MAX_BATCH, OnDuplicate
from delaysvc.serialize import ANSWER, Time

MAX_DEAD_PAGE = 1000
"""The most dead letters one `GET /dead` answers (`?limit=`, 100 by default)."""
FORBID_OTHERS = ConfigDict(extra="forbid")
"""The body may hold these fields only (the route refuses others, naming the first)."""


def whole(pattern: re.Pattern[str]) -> str:
    """`pattern` (checked with `fullmatch`) as a JSON Schema pattern, which matches anywhere
    in the string unless anchored."""
    return f"^(?:{pattern.pattern})$"


_NO_NUL = r"^[^\x00]*$"
Topic = Annotated[str, StringConstraints(pattern=whole(TOPIC_PATTERN))]
ScheduleName = Annotated[str, StringConstraints(pattern=whole(SCHEDULE_NAME_PATTERN))]
Key = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_KEY_CHARS, pattern=f"^[^{CONTROL_CHARS}]*$"),
]
Tag = Annotated[str, StringConstraints(pattern=whole(TAG_PATTERN))]
PropertyName = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_PROPERTY_NAME, pattern=_NO_NUL)
]
PropertyValue = Annotated[str, StringConstraints(max_length=MAX_PROPERTY_VALUE, pattern=_NO_NUL)]
Duration = Annotated[
    str, StringConstraints(pattern=whole(DURATION_PATTERN)), Field(examples=["30m", "1h30m"])
]
Rate = Annotated[
    str,
    StringConstraints(pattern=rf"^\s*(?:{RATE_PATTERN.pattern})\s*$"),
    Field(examples=["10/s", "600/m"]),
]


@with_config(FORBID_OTHERS)
class MessageFieldsJson(TypedDict):
    """A message to send: its topic and body; when it is due, by at most one of delay_level,
    delay, delay_ms and deliver_at (none: the topic's default delay, else now); its key, tags,
    properties and priority. A field given as null is not given."""

    topic: Topic
    body: Annotated[
        Any, Field(description="any JSON value, at most DELAYSVC_MAX_BODY_BYTES encoded")
    ]
    delay_level: NotRequired[
        Annotated[
            int | None,
            Field(description="above the highest level: the highest; 0 or less: no delay"),
        ]
    ]
    delay: NotRequired[Duration | None]
    delay_ms: NotRequired[Annotated[int, Field(ge=0)] | None]
    deliver_at: NotRequired[
        Annotated[
            Time | None,
            Field(
                description="a time already past is due at once: stored as due when stored, "
                "`scheduled` until the timer lane moves it (the database's clock says when "
                "it is due)"
            ),
        ]
    ]
    key: NotRequired[Key | None]
    tags: NotRequired[Annotated[list[Tag], Field(max_length=MAX_TAGS)] | None]
    properties: NotRequired[
        Annotated[dict[PropertyName, PropertyValue], Field(max_length=MAX_PROPERTIES)] | None
    ]
    priority: NotRequired[
        Annotated[
            int | None,
            Field(
                ge=-MAX_PRIORITY,
                le=MAX_PRIORITY,
                description="higher is claimed first within the topic; 0 by default",
            ),
        ]
    ]


@with_config(FORBID_OTHERS)
class NewMessageJson(MessageFieldsJson):
    """A message to send, and what to do when its key is held."""

    on_duplicate: NotRequired[
        Annotated[
            OnDuplicate,
            Field(
                description="when an unfinished message of the topic holds the key: return it "
                "(keep, the default), put this body and due time in its place (replace), or do "
                "so but never due earlier than it was (debounce); single sends only; replace "
                "and debounce need a key (400 without one)"
            ),
        ]
    ]


@with_config(FORBID_OTHERS)
class NewBatchJson(TypedDict):
    """Messages to send, all or none."""

    messages: Annotated[list[MessageFieldsJson], Field(min_length=1, max_length=MAX_BATCH)]


@with_config(FORBID_OTHERS)
class LimitsChangeJson(TypedDict):
    """A topic's limits; a field left out or null lifts that limit."""

    max_running: NotRequired[Annotated[int, Field(ge=1, le=MAX_RUNNING)] | None]
    rate: NotRequired[
        Annotated[
            Rate | Annotated[float, Field(ge=MIN_RATE_PER_S, le=MAX_RATE_PER_S)] | None,
            Field(
                description=f"starts per time ('10/s', '600/m', '100/h') or per second; at "
                f"least one a day ({MIN_RATE_PER_S:.7f}/s), at most {MAX_RATE_PER_S}/s"
            ),
        ]
    ]


@with_config(FORBID_OTHERS)
class CapChangeJson(TypedDict):
    """A backlog cap; max_waiting left out or null lifts it."""

    max_waiting: NotRequired[Annotated[int, Field(ge=1, le=MAX_WAITING)] | None]
    policy: NotRequired[
        Annotated[
            CapPolicy | None,
            Field(description="reject a send when full (the default), or deliver the oldest"),
        ]
    ]


@with_config(FORBID_OTHERS)
class NewScheduleJson(TypedDict):
    """A periodic schedule: when, what it sends to which topic."""

    schedule: Annotated[
        str,
        Field(
            description="a cron expression of five fields (`*/5 * * * *`), or an interval of "
            "1s to 3650d (`30s`, `every 1h`)"
        ),
    ]
    topic: Topic
    body: NotRequired[
        Annotated[
            Any,
            Field(
                description="any JSON value (default null), at most "
                f"{MAX_SCHEDULE_BODY_BYTES // 1024} KiB encoded"
            ),
        ]
    ]
    timezone: NotRequired[Annotated[str, Field(description="IANA name, default UTC")]]
    on_missed: NotRequired[
        Annotated[
            OnMissed,
            Field(
                description="ticks missed while nothing fired: none (skip, the default), or "
                "the latest of them (latest)"
            ),
        ]
    ]


@with_config(ANSWER)
class DeletedJson(TypedDict):
    """What a delete answers."""

    deleted: Annotated[str, Field(description="the name of what was deleted")]


@with_config(ANSWER)
class ProblemJson(TypedDict):
    code: Annotated[str, Field(description="what went wrong, such as `invalid`, `not_found`")]
    message: Annotated[str, Field(description="for a person: the field at fault and why")]


@with_config(ANSWER)
class ErrorJson(TypedDict):
    """Every error's answer (`delaysvc.web.errors`)."""

    error: ProblemJson
