"""One exception hierarchy for the whole service.

Every error a user can cause is a `DelaysvcError` with a stable `code`; the HTTP layer maps the
codes to status codes in one place (`delaysvc.web.errors`), the CLI prints the message on one line.
"""

SHOWN_CHARS = 80


def shown(value: object) -> str:
    """A value an error message quotes (`repr`), cut to SHOWN_CHARS: a request may hold a value
    of megabytes, which its error would otherwise send back whole."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = len(value) if isinstance(value, str) else len(text)  # a string's own, not its repr's
    return f"{text[: SHOWN_CHARS - 20]}... ({size:,} characters)"


def one_line(error: object) -> str:
    """An error's text for a log field or a message, on one line: a database error's own (its
    driver's, without SQLAlchemy's statement and link), its lines and runs of spaces joined."""
    return " ".join(str(getattr(error, "orig", None) or error).split())


class DelaysvcError(Exception):
    """Base of every error delaysvc raises on purpose."""

    code = "error"


class ConfigError(DelaysvcError):
    """A setting is malformed or contradicts another one (start-up refuses to continue)."""

    code = "config_error"


class ValidationError(DelaysvcError):
    """A value given to the producer or the API is not allowed; `field` names it."""

    code = "invalid"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class TooLarge(ValidationError):
    code = "too_large"


class NotFound(DelaysvcError):
    code = "not_found"


class NotCancellable(DelaysvcError):
    """The message is already running or finished."""

    code = "not_cancellable"


class DuplicateKey(DelaysvcError):
    """Another unfinished message of the topic holds the key."""

    code = "duplicate_key"


class DeclaredInCode(DelaysvcError):
    """A periodic schedule declared in code (`@periodic`) is changed there, not at run time."""

    code = "declared_in_code"


class BacklogFull(DelaysvcError):
    """A backlog cap with the `reject` policy is reached."""

    code = "backlog_full"


class NotStuck(DelaysvcError):
    """An operator asked to skip a lane's head, but the lane is not stuck on it (any more)."""

    code = "not_stuck"


class Busy(DelaysvcError):
    """What the call needs is held by another transaction for longer than it waits (the
    history, while an archive drops a day): nothing was done; try again."""

    code = "busy"


class SchemaNotReady(DelaysvcError):
    """The database has not been migrated for the configured delay levels."""

    code = "schema_not_ready"


class DatabaseUnavailable(DelaysvcError):
    """The database could not be reached, or the connection was lost mid-call (a restart, a
    failover). `maybe_stored` is True only when it was lost after the write was sent (a
    single send commits with its one statement; a batch, at COMMIT): the write may have
    landed, so send again with the same key (a resend of a keyed message cannot duplicate
    it). A pooled connection the server closed while idle is replaced before use, so a
    restart between two sends costs no error at all."""

    code = "unavailable"

    def __init__(self, message: str, *, maybe_stored: bool):
        super().__init__(message)
        self.maybe_stored = maybe_stored


class MissingPart(DelaysvcError):
    """Something to install first (PySpark, Java, the JDBC driver); the message names what to
    install and how."""

    code = "missing_part"


class LeaseLost(DelaysvcError):
    """A transactional handler's job is no longer its claim's (its lease expired and another
    consumer took it): its transaction rolls back, and nothing of it is written."""

    code = "lease_lost"

    def __init__(self, message_id: int):
        super().__init__(
            f"message {message_id}: its lease expired and another consumer took it; "
            "this run's transaction was rolled back"
        )
        self.message_id = message_id


class HandlerSignal(Exception):
    """Base of the exceptions a handler raises to steer its message."""


class RetryLater(HandlerSignal):
    """Raise from a handler to run the message again after `delay` (or `delay_ms`); without
    either, at the retry levels' next delay, as a failure would. It is a retry all the same:
    it counts against the handler's `max_retries`."""

    def __init__(self, delay: str | None = None, *, delay_ms: int | None = None, reason: str = ""):
        given = delay if delay is not None else delay_ms
        super().__init__(reason or ("retry later" if given is None else f"retry later ({given})"))
        self.delay = delay
        self.delay_ms = delay_ms
        self.reason = reason


class DeadLetter(HandlerSignal):
    """Raise from a handler to park the message in the dead letters now, without retrying."""

    def __init__(self, reason: str | None = "dead-lettered by handler"):
        reason = reason or "dead-lettered by handler"  # None or "": a dead letter all the same
        super().__init__(reason)
        self.reason = reason
