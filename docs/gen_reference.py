"""The reference pages' generated parts, written from the code: the settings from the settings
model, the commands from the click group, the HTTP API from the Flask routes and the OpenAPI
document the app serves.

Each page under docs/reference/ is prose written by hand with generated blocks between
`<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED: name -->`; this script rewrites
those blocks and leaves the rest. Run it after changing a setting, a command or a route:

    python docs/gen_reference.py           # rewrite the blocks
    python docs/gen_reference.py --check   # exit 1 naming each stale page, write nothing

tests/unit/test_docs_reference.py runs the same check. No database is needed.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
REFERENCE = DOCS / "reference"
API_PREFIX = "/api/v1"

BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[a-z-]+) -->\n)"
    r"(?P<body>.*?)"
    r"(<!-- END GENERATED: (?P=name) -->)",
    re.DOTALL,
)

# Settings the model has no docstring for yet: said here until settings.py says it.
# Variables that are read outside the Settings object (settings.py names them).
OTHER_VARIABLES = {
    "schema": "The PostgreSQL schema delaysvc's tables live in (lower-case letters, digits, "
    "`_`; default `delaysvc`). Read once per process, at its first statement.",
    "DELAYSVC_NEW_USER_PASSWORD": "Read by `delaysvc create-user` only: the new user's "
    "password, instead of a prompt.",
}


# -- settings ---------------------------------------------------------------------------------


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a class's attributes (`name: T = x` then `\"\"\"...\"\"\"`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    found: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return found


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= 10_000:
        return f"`{value}` ({value:,})"
    return f"`{value}`"


def _bounds(metadata: list[Any]) -> str:
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = []
    for item in metadata:
        for name, sign in signs.items():
            bound = getattr(item, name, None)
            if bound is not None:
                parts.append(f"{sign} {bound:,}" if isinstance(bound, int) else f"{sign} {bound}")
    return ", ".join(parts)


def _type(annotation: Any) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return " or ".join(f"`{value}`" for value in args)
    if type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        return " or ".join(_type(arg) for arg in rest) + ", or unset"
    return f"`{getattr(annotation, '__name__', annotation)}`"


def setting_rows() -> list[tuple[str, str, str, str]]:
    """(variable, type, default, meaning) for every setting, in the model's order."""
    from delaysvc.config.settings import PROCESS_SETTINGS, Settings

    docs = _attribute_docs(Settings)
    rows = []
    for name, field in Settings.model_fields.items():
        meaning = docs.get(name, "")
        bounds = _bounds(field.metadata)
        kind = _type(field.annotation) + (f" ({bounds})" if bounds else "")
        rows.append((f"DELAYSVC_{name.upper()}", kind, _default(field.default), meaning))
    for name in sorted(PROCESS_SETTINGS):
        rows.append((f"DELAYSVC_{name.upper()}", "`str`", "`delaysvc`", OTHER_VARIABLES[name]))
    return rows


def command_variable_rows() -> list[tuple[str, str]]:
    from delaysvc.config.settings import COMMAND_VARIABLES

    return [(name, OTHER_VARIABLES.get(name, "")) for name in sorted(COMMAND_VARIABLES)]


def settings_block() -> str:
    lines = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for variable, kind, default, meaning in setting_rows():
        lines.append(f"| `{variable}` | {kind} | {default} | {_cell(meaning)} |")
    lines += ["", "Read by one command, not settings:", ""]
    lines += ["| Variable | Meaning |", "|---|---|"]
    for variable, meaning in command_variable_rows():
        lines.append(f"| `{variable}` | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


# -- CLI --------------------------------------------------------------------------------------


def commands() -> list[tuple[str, str]]:
    """(`delaysvc dead list`, its one-line help) for every command, groups walked."""
    import click

    from delaysvc.cli import cli

    found: list[tuple[str, str]] = []

    def walk(command: click.Command, path: list[str]) -> None:
        if isinstance(command, click.Group):
            for name in sorted(command.commands):
                walk(command.commands[name], [*path, name])
        else:
            found.append((" ".join(path), command.get_short_help_str(limit=200)))

    walk(cli, ["delaysvc"])
    return found


def cli_block() -> str:
    lines = ["| Command | What it does |", "|---|---|"]
    for path, short in commands():
        anchor = path.replace(" ", "-")  # the heading mkdocs-click renders below
        lines.append(f"| [`{path}`](#{anchor}) | {_cell(short) or '(see below)'} |")
    return "\n".join(lines) + "\n"


# -- HTTP API ---------------------------------------------------------------------------------


def routes() -> list[tuple[str, str, str]]:
    """(method, path, scope) of every route the app serves under /api/v1, from Flask's own
    routing (the blueprint, not a list kept beside it); the path after the prefix, in
    OpenAPI's `{name}` form, as the document's paths are."""
    from flask import Flask

    from delaysvc.web.api import api

    app = Flask("delaysvc-docs")
    app.register_blueprint(api, url_prefix=API_PREFIX)
    found = []
    for rule in app.url_map.iter_rules():
        if not rule.rule.startswith(API_PREFIX):
            continue
        view = app.view_functions[rule.endpoint]
        scope = getattr(view, "required_scope", "none")
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule[len(API_PREFIX) :])
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            found.append((method, path, scope))
    order = list(api_document()["paths"])  # the document's order: messages first
    return sorted(
        found,
        key=lambda r: (order.index(r[1]) if r[1] in order else len(order), r[1], _rank(r[0])),
    )


def _rank(method: str) -> int:
    return _METHOD_ORDER.index(method) if method in _METHOD_ORDER else len(_METHOD_ORDER)


_METHOD_ORDER = ["GET", "POST", "PUT", "DELETE", "PATCH"]


def api_document() -> dict[str, Any]:
    from delaysvc.web.openapi import document

    return document()


def _ref_name(schema: dict[str, Any]) -> str | None:
    """The component a `{"$ref": "#/components/schemas/Name"}` names, else None."""
    ref = schema.get("$ref")
    return None if ref is None else str(ref).rsplit("/", 1)[-1]


def _schema_type(schema: dict[str, Any]) -> str:
    name = _ref_name(schema)
    if name is not None:
        return f"[{name}](#{name.lower()})"  # its fields: the Answers section
    if "anyOf" in schema:
        return " or ".join(_schema_type(each) for each in schema["anyOf"])
    if "enum" in schema:
        return " or ".join("`null`" if v is None else f"`{v}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind is None:
        return "any JSON"
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array" and "items" in schema:
        return f"array of {_schema_type(schema['items'])}"
    return str(kind)


_LIMITS = (
    ("min", "minimum", ""),
    ("more than", "exclusiveMinimum", ""),
    ("max", "maximum", ""),
    ("at least", "minLength", " characters"),
    ("at most", "maxLength", " characters"),
    ("at most", "maxItems", " items"),
    ("at least", "minItems", " items"),
    ("at most", "maxProperties", " pairs"),
)


def _schema_notes(schema: dict[str, Any]) -> str:
    notes = [_schema_notes(each) for each in schema.get("anyOf", [])]
    for word, key, unit in _LIMITS:
        if key in schema:
            one = schema[key] == 1 and unit.endswith("s")
            notes.append(f"{word} {schema[key]:,}{unit[:-1] if one else unit}")
    if "pattern" in schema:
        notes.append(f"pattern `{schema['pattern']}`")
    if "propertyNames" in schema:
        notes.append(f"names: {_schema_notes(schema['propertyNames'])}")
    if isinstance(schema.get("additionalProperties"), dict):
        notes.append(f"values: {_schema_notes(schema['additionalProperties'])}")
    if "items" in schema and _ref_name(schema["items"]) is None:
        notes.append(f"each: {_schema_notes(schema['items'])}")
    if "format" in schema:
        notes.append(schema["format"])
    if "description" in schema:
        notes.append(schema["description"])
    return "; ".join(note for note in notes if note and not note.endswith(": "))


def _fields(schema: dict[str, Any], required_word: str = "Required") -> list[str]:
    required = set(schema.get("required", []))
    lines = [f"| Field | Type | {required_word} | Notes |", "|---|---|---|---|"]
    for name, prop in schema.get("properties", {}).items():
        lines.append(
            f"| `{name}` | {_schema_type(prop)} | {'yes' if name in required else ''} | "
            f"{_cell(_schema_notes(prop))} |"
        )
    return lines


def _resolved(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    name = _ref_name(schema)
    return schema if name is None else components[name]  # type: ignore[no-any-return]


def _request_schema(
    operation: dict[str, Any], components: dict[str, Any]
) -> tuple[dict[str, Any], bool] | None:
    """The body's schema, and whether it is a batch's: then the schema of one item."""
    body = operation.get("requestBody")
    if body is None:
        return None
    schema = _resolved(body["content"]["application/json"]["schema"], components)
    if list(schema.get("properties", {})) == ["messages"]:  # the batch: one item's fields
        return _resolved(schema["properties"]["messages"]["items"], components), True
    return schema, False


def _answer(response: dict[str, Any]) -> str:
    """What a success answers: a component, or an object of them."""
    schema = response.get("content", {}).get("application/json", {}).get("schema", {})
    if "$ref" in schema:
        return _schema_type(schema)
    fields = schema.get("properties", {})
    return ", ".join(f"`{name}`: {_schema_type(prop)}" for name, prop in fields.items())


def _operation(
    method: str, path: str, scope: str, operation: dict[str, Any], components: dict[str, Any]
) -> list[str]:
    lines = [f"### `{method} {API_PREFIX}{path}`", "", operation.get("summary", "") + ".", ""]
    lines += [f"Token scope: {_SCOPES[scope]}.", ""]
    parameters = [p for p in operation.get("parameters", []) if p["in"] == "query"]
    if parameters:
        lines += ["| Query parameter | Type | Required |", "|---|---|---|"]
        for parameter in parameters:
            required = "yes" if parameter.get("required") else ""
            schema = parameter["schema"]
            kind = _schema_type(schema)
            notes = _schema_notes(schema)
            lines.append(
                f"| `{parameter['name']}` | {kind}{f' ({notes})' if notes else ''} | {required} |"
            )
        lines.append("")
    request = _request_schema(operation, components)
    if request is not None:
        schema, batch = request
        if batch:
            lines += ['Body: `{"messages": [...]}`, each item with these fields:', ""]
        else:
            lines += ["Body:", ""]
        lines += [*_fields(schema), ""]
    lines += ["| Status | Meaning | Answer |", "|---|---|---|"]
    for status, response in sorted(operation["responses"].items()):
        meaning = _cell(response.get("description") or "the document")
        answer = _cell(_answer(response)) if status.startswith("2") else "[Error](#error)"
        lines.append(f"| {status} | {meaning} | {answer} |")
    lines.append("")
    return lines


def _answered(document: dict[str, Any]) -> list[str]:
    """The components the routes answer with, and those they hold, in order of first use."""
    found: list[str] = []

    def visit(schema: Any) -> None:
        if isinstance(schema, dict):
            name = _ref_name(schema)
            if name is not None and name not in found:
                found.append(name)
                visit(document["components"]["schemas"][name])
            for value in schema.values():
                visit(value)
        elif isinstance(schema, list):
            for value in schema:
                visit(value)

    for item in document["paths"].values():
        for method, operation in item.items():
            if method != "parameters":
                visit(operation["responses"])
    return found


def _answers(document: dict[str, Any]) -> list[str]:
    lines = ["## Answers", ""]
    lines += ["The fields of each answer; an answer holds no others. Times are ISO 8601.", ""]
    for name in _answered(document):
        schema = document["components"]["schemas"][name]
        lines += [f"### {name}", ""]
        if "description" in schema:
            lines += [" ".join(schema["description"].split()), ""]
        lines += [*_fields(schema, "Always"), ""]
    return lines


_SCOPES = {
    "send": "`send` or `admin`",
    "admin": "`admin`",
    "none": "none (open)",
}


def api_block() -> str:
    document = api_document()
    served = routes()
    lines = ["| Method | Path | Scope | What it does |", "|---|---|---|---|"]
    for method, path, scope in served:
        operation = document["paths"].get(path, {}).get(method.lower(), {})
        summary = operation.get("summary", "(not in the OpenAPI document)")
        lines.append(f"| {method} | `{API_PREFIX}{path}` | {_SCOPES[scope]} | {_cell(summary)} |")
    lines.append("")
    components = document["components"]["schemas"]
    for method, path, scope in served:
        operation = document["paths"].get(path, {}).get(method.lower())
        if operation is not None:
            lines += _operation(method, path, scope, operation, components)
    lines += _answers(document)
    return "\n".join(lines)


# -- pages ------------------------------------------------------------------------------------

BLOCKS: dict[str, Callable[[], str]] = {
    "settings": settings_block,
    "cli": cli_block,
    "http-api": api_block,
}
PAGES = {
    "settings": REFERENCE / "settings.md",
    "cli": REFERENCE / "cli.md",
    "http-api": REFERENCE / "http-api.md",
}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(text: str) -> str:
    """`text` with every generated block rewritten from the code."""

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise KeyError(f"unknown generated block {name!r}")
        return match.group(1) + BLOCKS[name]() + match.group(4)

    return BLOCK.sub(replace, text)


def blocks_in(text: str) -> Iterator[str]:
    return (match["name"] for match in BLOCK.finditer(text))


def stale_pages() -> list[Path]:
    return [page for page in PAGES.values() if render(page.read_text()) != page.read_text()]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_pages()
        for page in stale:
            print(f"{page.relative_to(DOCS.parent)} is stale: run python docs/gen_reference.py")
        return 1 if stale else 0
    for page in PAGES.values():
        text = page.read_text()
        new = render(text)
        if new != text:
            page.write_text(new)
            print(f"wrote {page.relative_to(DOCS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
