"""JSON replies of structured calls: the reply format asked of the provider, reading and checking a
reply, the repair turn, and the reply schema every verdict list shares.

No litellm here (prompt and parsing code imports this module; importing litellm takes seconds). The
client that sends the calls is ``rubricem_core.llm.structured``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema

# How a JSON reply is asked for: the exact schema, any JSON object, or only the prompt's words.
STRUCTURED_OUTPUT_MODES: tuple[str, ...] = ("json_schema", "json_object", "none")
MAX_ERROR_CHARS = 600  # of a validation error, in the error text and in the repair turn


class ReplyError(ValueError):
    """A reply is unusable: not JSON, wrong shape, unknown ids, out-of-range scores."""


def response_format(mode: str, name: str, schema: dict[str, Any]) -> dict[str, Any] | None:
    """The ``response_format`` body field of a call whose reply must follow ``schema``."""
    if mode == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": False}}
    if mode == "json_object":
        return {"type": "json_object"}
    return None  # "none": the system prompt's schema is all the model gets


def load_json_reply(text: str | None) -> Any:
    if text is None:
        raise ReplyError("the reply has no text")
    stripped = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", stripped, re.S)  # models often fence JSON
    if fenced:
        stripped = fenced.group(1)
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as exc:
        raise ReplyError(f"the reply is not valid JSON: {exc}") from exc


def schema_error(data: Any, schema: dict[str, Any]) -> str | None:
    """The most relevant violation of ``schema`` by ``data`` (where, what), or None."""
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(data))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
    return f"at {where}: {error.message}"[:MAX_ERROR_CHARS]


def checked_reply(text: str | None, schema: dict[str, Any]) -> Any:
    """A reply's JSON when it follows ``schema``; ReplyError naming the first violation otherwise."""
    data = load_json_reply(text)
    problem = schema_error(data, schema)
    if problem:
        raise ReplyError(problem)
    return data


def repair_message(error: str) -> dict[str, str]:
    """The user turn that sends a reply's validation error back (after the reply itself)."""
    return {
        "role": "user",
        "content": (
            f"Your reply could not be used: {error[:MAX_ERROR_CHARS]}\n"
            "Reply again with only the corrected JSON object, following the schema in the instructions."
        ),
    }


# ---- the verdict list: one entry per asked id ------------------------------------------------------


def _entries(
    array: str, id_field: str, id_schema: dict[str, Any], fields: Mapping[str, Any], counts: Mapping[str, int]
) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            array: {
                "type": "array",
                **counts,
                "items": {
                    "type": "object",
                    "properties": {id_field: id_schema, **fields},
                    "required": [id_field, *fields],
                    "additionalProperties": False,
                },
            }
        },
        "required": [array],
        "additionalProperties": False,
    }


def one_entry_per_id(array: str, id_field: str, ids: Sequence[Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """``{array: [...]}`` with exactly one entry per asked id (``id_field``) and its ``fields`` — the shape of
    the judge's rubric scores, the reflection judge's candidate scores and the graders' item grades."""
    return _entries(array, id_field, {"enum": list(ids)}, fields, {"minItems": len(ids), "maxItems": len(ids)})


def entries_shape(array: str, id_field: str, id_schema: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """The same shape for any ids and count: what a system prompt shows. It is identical for every call
    (providers cache shared prompt prefixes); the exact schema travels as response_format."""
    return _entries(array, id_field, id_schema, fields, {})
