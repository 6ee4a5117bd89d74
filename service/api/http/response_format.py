"""OpenAI's ``response_format`` as the gRPC ``Submit.constraint``:

    {"type": "text"}                       no constraint (as absent)
    {"type": "json_object"}                any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}

``name`` (OpenAI requires it: letters, digits, ``_`` and ``-``, at most 64)
and ``description`` are checked and otherwise unused; ``strict`` may be
either: the output always follows the schema. A shape that is wrong is a
400 naming ``response_format`` here; a schema llguidance cannot compile is
one later, with its message, as over gRPC.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from slipstream.service.api.http.errors import invalid
from slipstream.v1 import inference_pb2 as pb

PARAM = "response_format"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's schema and function names
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


def set_response_format(body: Mapping[str, object], submit: pb.Submit) -> None:
    """Sets ``submit.constraint`` from the body's ``response_format``, if
    any; raises ``ApiError`` (400) for one that is not OpenAI's shape."""
    value = body.get(PARAM)
    if value is None:
        return
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("response_format must be an object with a type", PARAM)
    kind = value["type"]
    if kind not in ("text", "json_object", "json_schema"):
        message = f"response_format.type must be text, json_object or json_schema, not {kind!r}"
        raise invalid(message, PARAM)
    extra = set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"}
    if extra:
        raise invalid(f"response_format.{sorted(extra)[0]} is not supported with {kind}", PARAM)
    if kind == "json_object":
        submit.constraint.json_object = True
    elif kind == "json_schema":
        submit.constraint.json_schema = _schema(value.get("json_schema"))


def _schema(spec: object) -> str:
    """``json_schema``'s schema as JSON text, its other keys checked."""
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema must be an object", PARAM)
    unknown = set(spec) - _JSON_SCHEMA_KEYS
    if unknown:
        raise invalid(f"response_format.json_schema.{sorted(unknown)[0]} is not supported", PARAM)
    name = spec.get("name")
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        message = (
            "response_format.json_schema.name is required: at most 64 letters, digits, "
            "underscores or dashes"
        )
        raise invalid(message, PARAM)
    for key, kind, words in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise invalid(f"response_format.json_schema.{key} must be {words}", PARAM)
    schema = spec.get("schema")
    if schema is None:  # OpenAI's default: a schema that accepts any JSON value
        schema = {}
    if not isinstance(schema, dict | bool):
        raise invalid("response_format.json_schema.schema must be a JSON Schema object", PARAM)
    return json.dumps(schema)  # ASCII: a lone surrogate stays an escape, never bad UTF-8
