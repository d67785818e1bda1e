"""How the web app writes its JSON answers: Flask's provider, the text written by orjson."""

from __future__ import annotations

from typing import Any

from flask.json.provider import DefaultJSONProvider

try:
    import orjson
except ImportError:  # not on CPython: Flask's own writes everything
    orjson = None  # type: ignore[assignment]

_COMPACT = {"separators": (",", ":")}  # what Flask's `response` asks of `dumps` but in debug
_OPTIONS = (
    0 if orjson is None else orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
)


class Answers(DefaultJSONProvider):
    """Flask's JSON provider (`app.json`, behind `jsonify`), its compact answers written by
    orjson, several times faster (a batch's answer of 1,000 messages:
    docs/benchmarks/2026-12-07-lazy-batch-result): the same values, keys in the order built,
    but characters beyond ASCII written as UTF-8 rather than as `\\u` escapes, a float
    spelled as orjson spells it (`1.5e-7` for `1.5e-07`, `0.00003` for `3e-05`: the same
    number), and NaN or an infinity as null (Flask wrote `NaN`, which is no JSON; no answer
    holds one). What orjson would write otherwise (times, dataclasses: Flask's `default`
    writes them) or refuses (an integer beyond 64 bits, a lone surrogate, a key that is not a
    string) and the debug mode's indented answers are Flask's own. Reading stays Flask's:
    `api.json_body` names its errors."""

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        if orjson is None or kwargs != _COMPACT:
            return super().dumps(obj, **kwargs)
        options = _OPTIONS | orjson.OPT_SORT_KEYS if self.sort_keys else _OPTIONS
        try:
            return orjson.dumps(obj, self.default, options).decode()
        except TypeError:  # orjson.JSONEncodeError
            return super().dumps(obj, **kwargs)
