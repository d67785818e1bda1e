"""The HTTP API fuzzed from its own OpenAPI document (schemathesis): whatever the input, no
5xx, and every response matches the documented status codes, content type and schema."""

from __future__ import annotations

import pytest
import schemathesis
from flask import Flask
from hypothesis import HealthCheck, settings
from sqlalchemy import Engine

from delaysvc import auth
from tests.support.passes import second_pass_only


@pytest.fixture
def api_schema(app: Flask):  # type: ignore[no-untyped-def]
    # the tests bring a valid admin token themselves; authentication failures are covered
    # in test_api.py, so the fuzzer does not generate (and then see overridden) credentials
    from schemathesis.config import (
        GenerationConfig,
        ProjectConfig,
        ProjectsConfig,
        SchemathesisConfig,
    )

    generation = GenerationConfig(with_security_parameters=False)
    config = SchemathesisConfig(
        projects=ProjectsConfig(default=ProjectConfig(generation=generation))
    )
    return schemathesis.openapi.from_wsgi("/api/v1/openapi.json", app, config=config)


@pytest.fixture
def admin(engine: Engine) -> dict[str, str]:
    return {"Authorization": f"Bearer {auth.create_token(engine, 'fuzz', 'admin')}"}


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@second_pass_only(
    "~14 s, the API's answers to generated input, the same on either server but for the "
    "schema's name"
)
def test_no_input_gets_a_5xx_or_an_undocumented_response(case, admin):  # type: ignore[no-untyped-def]
    # Every check but "schema-valid input is accepted": the API has rules no JSON Schema
    # states (at most one of delay_level/delay/delay_ms/deliver_at, at most 400 days ahead,
    # the body size), and refuses such input with a documented 400/413.
    case.call_and_validate(
        headers=admin, excluded_checks=[schemathesis.checks.positive_data_acceptance]
    )
