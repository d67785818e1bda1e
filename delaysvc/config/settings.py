"""All configuration in one typed object, read from `DELAYSVC_*` variables at the edge.

Library code never reads the environment: the CLI, the Flask app factory and the Celery app
build a `Settings` (`Settings.from_env()`) and pass it down. Validation happens here, as a whole,
so a bad value stops start-up with a message that names the variable and what is allowed.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from delaysvc.config.levels import DEFAULT_LEVELS, DelayLevels, format_ms, parse_duration_ms
from delaysvc.config.validation import (
    MAX_WAITING,
    ascii_digits,
    check_max_running,
    check_schema_name,
    parse_rate,
    validate_topic,
)
from delaysvc.errors import ConfigError
from delaysvc.errors import ValidationError as DelaysvcValidationError

log = logging.getLogger(__name__)
CapPolicy = Literal["reject", "deliver-early"]
LogFormat = Literal["text", "json"]
Pooling = Literal["session", "transaction", "transaction-prepared"]
POOLINGS: tuple[Pooling, ...] = ("session", "transaction", "transaction-prepared")
TRANSACTION_POOLINGS: tuple[Pooling, ...] = ("transaction", "transaction-prepared")
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
DEBIAN_JDBC_JAR = Path("/usr/share/java/postgresql.jar")  # apt-get install libpostgresql-jdbc-java
DAY_MS = 86_400_000
MAX_SETTING_DAYS = 3650
"""The longest delay and history retention a deployment may set (ten years): a due time or a
cut-off must stay a date both Python and PostgreSQL can hold."""
MAX_TASK_LEASE_SECONDS = 7 * 86_400
"""The longest lease a worker may take (DELAYSVC_TASK_LEASE_SECONDS; DELAYSVC_LEASE_SECONDS is
at most a day): `delaysvc check` flags a lease ending further ahead."""
MAX_STATEMENT_TIMEOUT_MS = 2_147_483_647  # PostgreSQL's statement_timeout is an int of ms
MIN_SECRET_KEY = 32
"""DELAYSVC_SECRET_KEY's shortest length (the keys made here are 64 hex characters)."""


@dataclass(frozen=True)
class BacklogCap:
    """At most `limit` pending messages in a level (`scope="level"`) or a topic."""

    scope: Literal["level", "topic"]
    target: str
    limit: int
    policy: CapPolicy


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    database_url: str | None = None
    """PostgreSQL's URL, `postgresql://user@host:port/db` (the service connects with psycopg 3:
    `postgresql+psycopg://` too, no other driver's); unset -> an embedded PostgreSQL under
    `var_dir`."""
    database_pooling: Pooling = "session"
    """What `database_url` reaches: `session`, a server or a session-pooling PgBouncer;
    `transaction`, a transaction-pooling PgBouncer, through which no statement is prepared on
    the server and nothing keeps a session (`delaysvc.db`); `transaction-prepared`, a
    transaction-pooling PgBouncer 1.22 or later with `max_prepared_statements` above 0, which
    keeps the prepared statements of its clients: statements are prepared, nothing keeps a
    session."""
    direct_database_url: str | None = None
    """A direct (or session-pooled) URL of the same database, for what keeps a session across
    transactions: the delivery worker's lanes and the archive's lock (`delaysvc migrate` and a
    delivery worker refuse one that reaches another database). Needed with
    `database_pooling=transaction` or `transaction-prepared`; unset otherwise, they use
    `database_url`."""
    broker_url: str | None = None
    """Celery broker (redis://, amqp://); unset -> a filesystem broker under `var_dir`."""
    delay_levels: str = DEFAULT_LEVELS
    """Delay level N is the Nth token (see *Delay level strings* below)."""
    handlers: str = ""
    """Comma-separated modules that register handlers with `@handler`."""
    topic_delays: str = ""
    """Per-topic default delays, `order.cancel=30m,sms.send=2h` (RabbitMQ's queue TTL)."""
    topic_tasks: str = ""
    """Topics bound to existing Celery tasks, `report.build=app.tasks.build_report`."""
    backlog_caps: str = ""
    """`level:16=100000:reject,topic:sms.send=5000:deliver-early`."""
    topic_max_running: str = ""
    """Jobs of a topic running at once, `sms.send=4,report.build=1` (`delaysvc.worker.limits`)."""
    topic_rates: str = ""
    """Starts of a topic per time, `sms.send=10/s,mail.send=600/m` (`delaysvc.worker.limits`)."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0, le=1_000_000_000)
    """The largest encoded body a send accepts."""
    max_delay: str = "400d"
    """The longest delay a send accepts (`delay`, `delay_ms` or `deliver_at`), at most 3650d."""
    history_retention: str | None = None
    """Finished messages are kept this long (`30d`), then their day of history is dropped whole
    (`delaysvc.maintenance.history`); unset, they stay until `delaysvc pipeline archive` copies them
    out."""
    max_retries: int = Field(default=16, ge=0, le=1000)
    """Retries before the dead letters; a handler's `max_retries=` overrides it."""
    lease_seconds: int = Field(default=30, gt=0, le=86_400)
    """A running job's lease: a thread of its process renews it every third of this while it
    lives, so a job is taken again this long (at most) after its process died, and never while
    it runs, unless its handler holds Python's GIL longer than a lease (one long C call that
    does not let go of it): make it longer than such a call."""
    start_wait_seconds: int = Field(default=60, ge=0, le=3600)
    """How long `delaysvc up` (on a configured database), `worker`, `beat` and `web` wait for a
    database that does not answer as they start (a host and its database booting together),
    with a line saying so, before they stop with its error (0: not at all)."""
    task_lease_seconds: int = Field(default=300, gt=0, le=MAX_TASK_LEASE_SECONDS)
    """The fixed lease of a job handed to a Celery task (`topic_tasks`): the task runs where
    delaysvc cannot renew it, so its job is taken again after this long without an outcome."""
    worker_max_memory_mb: int = Field(default=512, ge=0)
    """A consumer process using more than this after a task is replaced (0: never): a
    handler that leaks memory cannot take the worker down."""
    delivery_batch: int = Field(default=1000, gt=0, le=100_000)
    """Rows moved per delivery transaction."""
    consume_batch: int = Field(default=100, gt=0, le=10_000)
    """Jobs claimed per consumer transaction."""
    idle_poll_ms: int = Field(default=100, ge=10, le=60_000)
    """The longest sleep of the timer lane's runner (where a new message may become the head),
    and how often it looks for topics a send due at once reached, to wake their consumers."""
    lane_budget_seconds: float = Field(default=5.0, gt=0, le=300)
    """How long one delivery task keeps its lane before it re-queues itself; beat fires every
    lane's task this often."""
    var_dir: Path = Path("var")
    """The folder of the embedded database, the filesystem broker, the beat schedule and the
    session key."""
    secret_key: str | None = None
    """Signs the dashboard's session cookies (shared by every web worker), at least 32
    characters; unset, one is made once in `var/secret_key`."""
    secure_cookies: bool = False
    """Mark the dashboard's session cookie Secure (set it when the site is served over https)."""
    proxy_hops: int = Field(default=0, ge=0, le=10)
    """How many reverse proxies stand in front of `delaysvc web`: the client's address is then
    read from `X-Forwarded-For`, that many entries from its end. The dashboard counts failed
    logins per client address; behind a proxy left at 0, every client is the proxy."""
    statement_timeout_ms: int = Field(default=5_000, gt=0, le=MAX_STATEMENT_TIMEOUT_MS)
    """The statement timeout of the dashboard's and `/metrics`' queries."""
    metrics_token: str | None = None
    """When set, `GET /metrics` needs `Authorization: Bearer <this>`; unset, it is open."""
    metrics_max_topics: int = Field(default=50, ge=0, le=10_000)
    """Topics with series of their own in `GET /metrics`: those with the most jobs finished or
    retried since the database was created (ties: by name); the others are summed under
    `topic="other"`, so a scrape has at most this many topic label values plus `other`."""
    jdbc_jar: Path = DEBIAN_JDBC_JAR
    """The PostgreSQL JDBC driver's jar, for the pipeline's Spark reads (archive, report)."""
    log_format: LogFormat = "text"
    """How every process logs to stderr (`delaysvc.config.logs`): `text` lines, or `json`, one
    object per line with the record's structured fields."""

    @field_validator("delay_levels")
    @classmethod
    def _levels_parse(cls, value: str) -> str:
        try:
            DelayLevels.parse(value)
        except ConfigError as exc:
            raise ConfigError(f"DELAYSVC_DELAY_LEVELS={value!r}: {exc}") from None
        return value

    @field_validator("log_format", mode="before")
    @classmethod
    def _known_log_format(cls, value: object) -> object:
        return _choice("DELAYSVC_LOG_FORMAT", value, LOG_FORMATS, "a log format")

    @field_validator("database_pooling", mode="before")
    @classmethod
    def _known_pooling(cls, value: object) -> object:
        return _choice(
            "DELAYSVC_DATABASE_POOLING",
            value,
            POOLINGS,
            "a pooling mode",
            " (transaction: DELAYSVC_DATABASE_URL is a transaction-pooling PgBouncer; "
            "transaction-prepared: one of 1.22 or later with max_prepared_statements above 0)",
        )

    @field_validator("database_url", "direct_database_url")
    @classmethod
    def _psycopg_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            _check_database_url(f"DELAYSVC_{str(info.field_name).upper()}", value)
        return value

    @model_validator(mode="after")
    def _direct_url_is_not_the_pooled_one(self) -> Settings:
        """Behind a transaction pooler the direct URL is what keeps a session: the pooled URL
        given as it was taken for a direct one, and statements were prepared through the
        pooler."""
        direct, pooled = self.direct_database_url, self.database_url
        if (
            self.database_pooling in TRANSACTION_POOLINGS
            and direct is not None
            and pooled is not None
            and make_url(direct).set(drivername="postgresql")
            == make_url(pooled).set(drivername="postgresql")
        ):
            raise ConfigError(
                "DELAYSVC_DIRECT_DATABASE_URL: is DELAYSVC_DATABASE_URL, the transaction-pooling "
                f"PgBouncer's (DELAYSVC_DATABASE_POOLING={self.database_pooling}); set it to a "
                "direct or session-pooled URL of the same database"
            )
        return self

    @field_validator("secret_key")
    @classmethod
    def _key_is_long_enough(cls, value: str | None) -> str | None:
        length = None if value is None else len(value.strip())
        if length is not None and length < MIN_SECRET_KEY:
            raise ConfigError(
                f"DELAYSVC_SECRET_KEY: {length} characters (spaces at its ends not counted), at "
                f"least {MIN_SECRET_KEY} needed (a short key can be guessed offline from one "
                "session cookie); make one with "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        return value

    @field_validator("metrics_token")
    @classmethod
    def _token_is_one_word(cls, value: str | None) -> str | None:
        if value is not None and (not value.isprintable() or any(c.isspace() for c in value)):
            raise ConfigError(
                "DELAYSVC_METRICS_TOKEN: must be one word of printable characters, no spaces "
                "(Prometheus sends it as `Authorization: Bearer <token>`)"
            )
        return value

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> Settings:
        """Read and validate; any problem becomes one ConfigError naming the variable."""
        env = os.environ if environ is None else environ
        known = set(cls.model_fields)
        _warn_unknown(env, known | PROCESS_SETTINGS)
        if env.get("DELAYSVC_SCHEMA"):
            check_schema_name(env["DELAYSVC_SCHEMA"])
        values: dict[str, object] = {
            key[len("DELAYSVC_") :].lower(): value
            for key, value in env.items()
            if key.startswith("DELAYSVC_")
            and value != ""
            and key[len("DELAYSVC_") :].lower() in known
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            settings = cls.model_validate(values)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None
        settings.check()
        return settings

    def check(self) -> None:
        """Cross-field validation; touching each derived property parses it."""
        _ = (self.levels, self.handler_modules, self.default_delays_ms, self.task_topics)
        _ = (self.caps, self.max_delay_ms, self.topic_limits, self.history_retention_ms)
        for topic, delay_ms in self.default_delays_ms.items():
            if delay_ms > self.max_delay_ms:
                raise ConfigError(
                    f"DELAYSVC_TOPIC_DELAYS ({topic}): {format_ms(delay_ms)} is more than the "
                    f"maximum delay, {format_ms(self.max_delay_ms)} (DELAYSVC_MAX_DELAY)"
                )
        for cap in self.caps:
            if cap.scope == "level" and not 1 <= int(cap.target) <= self.levels.max_level:
                raise ConfigError(
                    f"DELAYSVC_BACKLOG_CAPS: level {cap.target} does not exist; "
                    f"levels are 1..{self.levels.max_level}"
                )

    @cached_property
    def levels(self) -> DelayLevels:
        return DelayLevels.parse(self.delay_levels)

    @cached_property
    def handler_modules(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.handlers.split(",") if m.strip())

    @cached_property
    def max_delay_ms(self) -> int:
        return _config_duration("DELAYSVC_MAX_DELAY", self.max_delay, at_most_days=MAX_SETTING_DAYS)

    @cached_property
    def history_retention_ms(self) -> int | None:
        if self.history_retention is None:
            return None
        retention = _config_duration(
            "DELAYSVC_HISTORY_RETENTION", self.history_retention, at_most_days=MAX_SETTING_DAYS
        )
        if retention < DAY_MS:
            raise ConfigError(
                f"DELAYSVC_HISTORY_RETENTION={self.history_retention!r}: history is dropped a "
                "whole day at a time, so keep it at least one day (e.g. 1d, 30d)"
            )
        return retention

    @cached_property
    def default_delays_ms(self) -> dict[str, int]:
        return {
            topic: _config_duration(f"DELAYSVC_TOPIC_DELAYS ({topic})", value)
            for topic, value in _pairs("DELAYSVC_TOPIC_DELAYS", self.topic_delays).items()
        }

    @cached_property
    def topic_limits(self) -> dict[str, tuple[int | None, float | None]]:
        """The configured limits, per topic: (max_running, rate_per_s)."""
        found: dict[str, tuple[int | None, float | None]] = {}
        for topic, value in _pairs("DELAYSVC_TOPIC_MAX_RUNNING", self.topic_max_running).items():
            number = int(value) if ascii_digits(value.strip()) else value
            try:
                found[topic] = (check_max_running(number), None)
            except DelaysvcValidationError as exc:
                raise ConfigError(f"DELAYSVC_TOPIC_MAX_RUNNING ({topic}): {exc.detail}") from None
        for topic, value in _pairs("DELAYSVC_TOPIC_RATES", self.topic_rates).items():
            try:
                rate = parse_rate(value.strip())
            except DelaysvcValidationError as exc:
                raise ConfigError(f"DELAYSVC_TOPIC_RATES ({topic}): {exc.detail}") from None
            found[topic] = (found.get(topic, (None, None))[0], rate)
        return found

    @cached_property
    def task_topics(self) -> dict[str, str]:
        return _pairs("DELAYSVC_TOPIC_TASKS", self.topic_tasks)

    @cached_property
    def caps(self) -> tuple[BacklogCap, ...]:
        caps = tuple(_parse_cap(item) for item in _items(self.backlog_caps))
        seen: set[tuple[str, str]] = set()
        for cap in caps:
            if (cap.scope, cap.target) in seen:
                raise ConfigError(
                    f"DELAYSVC_BACKLOG_CAPS: {cap.scope} {cap.target} is capped twice; "
                    "give each level or topic one cap"
                )
            seen.add((cap.scope, cap.target))
        return caps

    @property
    def embedded_database(self) -> bool:
        return self.database_url is None


PROCESS_SETTINGS = {"schema"}
"""Read by `delaysvc.db.names` for the whole process, not held by a Settings (`DELAYSVC_SCHEMA`)."""
TEST_PREFIX = "DELAYSVC_TEST_"
"""Variables of delaysvc's own test suite (`DELAYSVC_TEST_DATABASE_URL`, ...), not settings."""
COMMAND_VARIABLES = {"DELAYSVC_NEW_USER_PASSWORD"}
"""Read by one command, not settings (`delaysvc create-user` takes its password from it)."""


def _warn_unknown(env: Mapping[str, str], known: set[str]) -> None:
    """Name every `DELAYSVC_*` variable that is no setting, with the closest one: a typo must
    not pass silently for the default (`DELAYSVC_DATABSE_URL`)."""
    names = [f"DELAYSVC_{name.upper()}" for name in sorted(known)]
    for key in sorted(env):
        if not key.startswith("DELAYSVC_") or key.startswith(TEST_PREFIX):
            continue
        if key in COMMAND_VARIABLES:
            continue
        if key[len("DELAYSVC_") :].lower() in known:
            continue
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else "see docs/reference/settings.md"
        log.warning("%s is not a delaysvc setting and is ignored (%s)", key, hint)


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _pairs(variable: str, text: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in _items(text):
        topic, sep, value = item.partition("=")
        if not sep or not value.strip():
            raise ConfigError(f"{variable}: {item!r} is not topic=value")
        try:
            validate_topic(topic.strip())
        except DelaysvcValidationError as exc:
            raise ConfigError(f"{variable}: {exc}") from None
        if topic.strip() in pairs:
            raise ConfigError(f"{variable}: {topic.strip()!r} is given twice; give each topic once")
        pairs[topic.strip()] = value.strip()
    return pairs


def _config_duration(variable: str, text: str, *, at_most_days: int | None = None) -> int:
    try:
        ms = parse_duration_ms(text)
    except DelaysvcValidationError:
        raise ConfigError(
            f"{variable}: {text!r} is not a duration; use whole numbers with units ms, s, m, h, "
            "d such as '30d' or '1d12h'"
        ) from None
    if at_most_days is not None and ms > at_most_days * DAY_MS:
        raise ConfigError(f"{variable}: {text!r} is more than {at_most_days}d, the most allowed")
    return ms


def _parse_cap(item: str) -> BacklogCap:
    usage = "use level:N=LIMIT:POLICY or topic:NAME=LIMIT:POLICY, POLICY reject or deliver-early"
    scope, _, rest = item.partition(":")
    target, _, rest = rest.partition("=")
    limit, _, policy = rest.partition(":")
    if scope not in ("level", "topic") or not target or not ascii_digits(limit):
        raise ConfigError(f"DELAYSVC_BACKLOG_CAPS: {item!r} is malformed; {usage}")
    if policy not in ("reject", "deliver-early"):
        raise ConfigError(f"DELAYSVC_BACKLOG_CAPS: policy {policy!r} in {item!r}; {usage}")
    if scope == "level" and not ascii_digits(target):
        raise ConfigError(f"DELAYSVC_BACKLOG_CAPS: level {target!r} is not a number; {usage}")
    if scope == "level":
        target = str(int(target))  # level:05 is level 5's cap: one cap a level (`caps`)
    if not 1 <= int(limit) <= MAX_WAITING:
        raise ConfigError(
            f"DELAYSVC_BACKLOG_CAPS: limit in {item!r} must be from 1 to {MAX_WAITING:,}"
        )
    if scope == "topic":
        try:
            validate_topic(target)
        except DelaysvcValidationError as exc:
            raise ConfigError(f"DELAYSVC_BACKLOG_CAPS: {exc}") from None
    return BacklogCap(scope, target, int(limit), policy)  # type: ignore[arg-type]


def _choice(
    variable: str, value: object, allowed: tuple[str, ...], kind: str, hint: str = ""
) -> str:
    """`value` as one of `allowed` (any case, spaces around ignored), else a ConfigError
    naming the variable, the value and what is allowed."""
    if isinstance(value, str) and value.strip().lower() in allowed:
        return value.strip().lower()
    raise ConfigError(f"{variable}: {value!r} is not {kind}; use {' or '.join(allowed)}{hint}")


def _check_database_url(variable: str, url: str) -> None:
    """Refuse, naming `variable` and what it takes, a URL the service cannot connect with: its
    own connections are psycopg 3's (COPY, pipelines, prepared statements), so not another
    driver's (`postgresql+psycopg2://`), nor another database's. The URL is not repeated: it
    may hold a password."""
    try:
        backend, _, driver = make_url(url).drivername.partition("+")
    except ArgumentError:
        problem = "is not a database URL"
    else:
        if backend not in ("postgresql", "postgres"):
            problem = f"is a {backend} URL"
        elif driver not in ("", "psycopg"):
            problem = (
                f"names the driver {driver}; psycopg2 and asyncio drivers can join your own "
                "transactions (send(..., connection=...)), but the service's connections are "
                "psycopg 3's"
            )
        else:
            return
    raise ConfigError(
        f"{variable}: {problem}; use a PostgreSQL URL for psycopg 3: postgresql://user@host/db "
        "(or postgresql+psycopg://)"
    )


_ALLOWED = {
    "bool_parsing": "use true or false (or 1/0, yes/no, on/off)",
    "int_parsing": "use a whole number",
    "float_parsing": "use a number",
}
"""What a variable of each kind takes, by pydantic's error type: its own words say only what
failed ("Input should be a valid boolean, unable to interpret input")."""


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "settings"
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, ConfigError):
            message = str(cause)
        elif error["type"] in _ALLOWED:
            message = f"{error['input']!r} is not allowed; {_ALLOWED[error['type']]}"
        else:
            message = error["msg"]
        problems.append(f"DELAYSVC_{field.upper()}: {message}")
    return "; ".join(problems)
