"""The database URLs are checked where the settings are read: the service's own connections
are psycopg 3's, so a URL for another driver (SQLAlchemy's `postgresql+psycopg2://`, an
asyncio driver's) or another database is refused at start, naming the variable and what it
takes, not found out at the first connection (psycopg2's did not connect at all: every pooled
connection was taken for one the server had closed)."""

from __future__ import annotations

import pytest

from delaysvc.config.settings import Settings
from delaysvc.errors import ConfigError


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@h:5432/d",
        "postgres://u@h/d",
        "postgresql+psycopg://u@h/d?sslmode=disable",
    ],
)
@pytest.mark.parametrize("variable", ["DELAYSVC_DATABASE_URL", "DELAYSVC_DIRECT_DATABASE_URL"])
def test_a_url_psycopg_3_reaches_is_taken(variable: str, url: str) -> None:
    settings = Settings.from_env({variable: url})
    assert url in (settings.database_url, settings.direct_database_url)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql+psycopg2://u@h/d", "driver psycopg2"),
        ("postgresql+asyncpg://u@h/d", "driver asyncpg"),
        ("mysql://u@h/d", "a mysql URL"),
        ("localhost:5432", "not a database URL"),
    ],
)
@pytest.mark.parametrize("variable", ["DELAYSVC_DATABASE_URL", "DELAYSVC_DIRECT_DATABASE_URL"])
def test_a_url_for_another_driver_or_database_is_refused_naming_what_is_taken(
    variable: str, url: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({variable: url})
    message = str(refused.value)
    assert message.startswith(f"{variable}: ")
    assert problem in message
    assert "postgresql://" in message and "postgresql+psycopg://" in message
    assert "u@h" not in message  # a URL may hold a password: it is not echoed


# A setting that is taken must work everywhere it is used: values that were taken and then
# failed late (a send that stored a row no command could read back, /metrics' 400, a migrate
# traceback) are refused where the settings are read, naming the variable and the bound.
@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("DELAYSVC_MAX_DELAY", "3000000d", "more than 3650d"),
        ("DELAYSVC_HISTORY_RETENTION", "1000000d", "more than 3650d"),
        ("DELAYSVC_STATEMENT_TIMEOUT_MS", "99999999999999", "2147483647"),
        ("DELAYSVC_LEASE_SECONDS", "99999999999999", "86400"),
        ("DELAYSVC_TASK_LEASE_SECONDS", "99999999999999", "604800"),
        ("DELAYSVC_MAX_BODY_BYTES", "99999999999999", "1000000000"),
        ("DELAYSVC_TOPIC_DELAYS", "t=500d", "more than the maximum delay, 400d"),
        ("DELAYSVC_BACKLOG_CAPS", "level:1=99999999999999999999:reject", "1 to 1,000,000,000"),
        ("DELAYSVC_BACKLOG_CAPS", "topic:t=1000000001:reject", "1 to 1,000,000,000"),
        # any length was taken: a short key is guessed offline from one session cookie
        (
            "DELAYSVC_SECRET_KEY",
            "k" * 31,
            "31 characters (spaces at its ends not counted), at least 32",
        ),
        (
            "DELAYSVC_SECRET_KEY",
            " " * 40,
            "0 characters (spaces at its ends not counted), at least 32",
        ),
        ("DELAYSVC_PROXY_HOPS", "11", "10"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_the_variable_and_the_bound(
    variable: str, value: str, said: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({variable: value})
    assert variable in str(refused.value)
    assert said in str(refused.value)


def test_the_bounds_themselves_are_taken() -> None:
    settings = Settings.from_env(
        {
            "DELAYSVC_MAX_DELAY": "3650d",
            "DELAYSVC_HISTORY_RETENTION": "3650d",
            "DELAYSVC_TOPIC_DELAYS": "t=3650d",
            "DELAYSVC_BACKLOG_CAPS": "topic:t=1000000000:reject",
            "DELAYSVC_LEASE_SECONDS": "86400",
            "DELAYSVC_SECRET_KEY": "k" * 32,
        }
    )
    assert settings.default_delays_ms == {"t": 3650 * 86_400_000}


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DELAYSVC_TOPIC_DELAYS", "t=1m,u=2m,t=5m"),
        ("DELAYSVC_TOPIC_MAX_RUNNING", "t=1,t=4"),
        ("DELAYSVC_TOPIC_RATES", "t=1/s, t=5/s"),
        ("DELAYSVC_TOPIC_TASKS", "t=a.b,t=c.d"),
        ("DELAYSVC_BACKLOG_CAPS", "level:2=10:reject,level:2=20:deliver-early"),
        # the same level spelled twice: migrate stored the last, a producer kept to the first
        ("DELAYSVC_BACKLOG_CAPS", "level:5=5:reject,level:05=7:deliver-early"),
        ("DELAYSVC_BACKLOG_CAPS", "topic:t=10:reject,topic:t=20:reject"),
    ],
)
def test_an_entry_given_twice_is_refused_not_overridden_by_the_last(
    variable: str, value: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({variable: value})
    assert str(refused.value).startswith(variable)
    assert "twice" in str(refused.value)


@pytest.mark.parametrize("pooling", ["transaction", "transaction-prepared"])
def test_a_direct_url_that_is_the_pooled_url_is_refused(pooling: str) -> None:
    """Copied across to make the worker start, it was taken for the direct one: psycopg then
    prepared statements through the transaction pooler (19 of 20 sends failed with "_pg3_0
    already exists") and the lanes' session locks went through it too."""
    pooled = "postgresql://u@pgbouncer:6432/d"
    for direct in (pooled, "postgresql+psycopg://u@pgbouncer:6432/d"):
        env = {
            "DELAYSVC_DATABASE_URL": pooled,
            "DELAYSVC_DATABASE_POOLING": pooling,
            "DELAYSVC_DIRECT_DATABASE_URL": direct,
        }
        with pytest.raises(ConfigError) as refused:
            Settings.from_env(env)
        assert str(refused.value) == (
            "DELAYSVC_DIRECT_DATABASE_URL: is DELAYSVC_DATABASE_URL, the transaction-pooling "
            f"PgBouncer's (DELAYSVC_DATABASE_POOLING={pooling}); set it to a direct or "
            "session-pooled URL of the same database"
        )
    # behind a session pooler (or none) the two may be the same
    same = {"DELAYSVC_DATABASE_URL": pooled, "DELAYSVC_DIRECT_DATABASE_URL": pooled}
    assert Settings.from_env(same).direct_database_url == pooled


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("DELAYSVC_SECURE_COOKIES", "maybe", "'maybe' is not allowed; use true or false"),
        ("DELAYSVC_LEASE_SECONDS", "30s", "'30s' is not allowed; use a whole number"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_saying_what_is_taken(
    variable: str, value: str, said: str
) -> None:
    """pydantic's own words said only what failed ("Input should be a valid boolean, unable to
    interpret input"), not what the variable takes (found by a reviewer)."""
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({variable: value})
    assert str(refused.value) == f"{variable}: {said}" + (
        " (or 1/0, yes/no, on/off)" if "true or false" in said else ""
    )
