"""Domain errors -> HTTP status codes, in one place. Every error body is
`{"error": {"code": ..., "message": ...}}`."""

from __future__ import annotations

import logging

from flask import Flask, jsonify
from sqlalchemy.exc import DataError, OperationalError, ProgrammingError
from werkzeug.exceptions import HTTPException

from delaysvc.errors import DelaysvcError
from delaysvc.store import not_migrated

log = logging.getLogger(__name__)

STATUS = {
    "invalid": 400,
    "too_large": 413,
    "not_found": 404,
    "not_cancellable": 409,
    "duplicate_key": 409,
    "not_stuck": 409,
    "declared_in_code": 409,
    "backlog_full": 429,
    "schema_not_ready": 503,
    "busy": 503,
    "unavailable": 503,
    "config_error": 500,
}


def error_response(status: int, code: str, message: str):
    response = jsonify({"error": {"code": code, "message": message}})
    response.status_code = status
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(DelaysvcError)
    def domain_error(exc: DelaysvcError):
        response = error_response(STATUS.get(exc.code, 400), exc.code, str(exc))
        if response.status_code == 503:
            response.headers["Retry-After"] = "1"
        return response

    @app.errorhandler(OperationalError)
    def database_unavailable(exc: OperationalError):
        # a restart or failover under a read (sends say more: DatabaseUnavailable)
        log.warning("web.database_unavailable", extra={"error": str(exc.orig)})
        response = error_response(503, "unavailable", "the database is not answering; retry")
        response.headers["Retry-After"] = "1"
        return response

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        code = (exc.name or "error").lower().replace(" ", "_")
        message = exc.description or exc.name
        limit = app.config.get("MAX_CONTENT_LENGTH")
        if exc.code == 413 and limit is not None:
            message = f"the request body is over {limit:,} bytes, the most this server takes"
        response = error_response(exc.code or 500, code, message)
        allow = exc.get_response().headers.get("Allow")  # a 405 says what is allowed
        if allow:
            response.headers["Allow"] = allow
        return response

    @app.errorhandler(DataError)
    def refused_by_database(exc: DataError):
        # input no validator anticipated (a NUL byte, a number out of range): the client's
        # mistake, not the server's; logged so the validator can learn it
        log.warning("web.data_error", extra={"error": str(exc.orig)})
        return error_response(400, "invalid", f"a value was refused: {exc.orig}")

    @app.errorhandler(ProgrammingError)
    def not_migrated_yet(exc: ProgrammingError):
        # a table or column this release has and the database not yet: started before
        # `delaysvc migrate` (the processes check its revision at start; an app served by
        # another server may not have)
        missing = not_migrated(exc)
        if missing is None:
            return unexpected(exc)
        return domain_error(missing)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("web.unexpected_error")
        return error_response(500, "internal", "internal error; see the server log")
