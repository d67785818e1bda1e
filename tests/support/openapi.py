"""Real answers checked against the OpenAPI document (`GET /api/v1/openapi.json`): the schema
it gives for the route, the method and the answer's status, its `#/components/...` references
resolved in the document and its date-times checked."""

from __future__ import annotations

from typing import Any

from flask.testing import FlaskClient
from jsonschema import Draft202012Validator


class Documented:
    """The app's own document, read once through `client`."""

    def __init__(self, client: FlaskClient) -> None:
        self.document: dict[str, Any] = client.get("/api/v1/openapi.json").get_json()

    def answer(self, response: Any, path: str, method: str, status: int) -> Any:
        """`response`'s JSON, once its status is `status` and the document declares that
        status for `method` on `path` with a schema the JSON matches."""
        assert response.status_code == status, response.get_json()
        declared = self.document["paths"][path][method]["responses"]
        assert str(status) in declared, f"{method} {path} answered {status}, not documented"
        schema = declared[str(status)]["content"]["application/json"]["schema"]
        validator = Draft202012Validator(
            {**schema, "components": self.document["components"]},
            format_checker=Draft202012Validator.FORMAT_CHECKER,
        )
        validator.validate(response.get_json())
        return response.get_json()
