"""The configuration reference, written from the pydantic models themselves: every field of ``RunConfig``
with its dotted key, type, default and help text. ``make docs`` writes docs/reference/configuration.md
from it (``python -m rubricem_core.config_reference``) and tests/test_docs.py fails when the committed
page differs, so the page cannot drift from the code."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rubricem_core.config import RunConfig


@dataclass(frozen=True)
class FieldDoc:
    key: str  # dotted, as `--set` takes it
    type: str
    default: str
    help: str


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The one pydantic model an annotation holds (``X`` or ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _model_of(args[0])
    return None


def type_name(annotation: Any) -> str:
    """A short readable type: ``int``, ``"a" | "b"``, ``list[str]``, ``dict[str, BenchmarkGraderConfig]``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def _items_model(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """A list or dict of one pydantic model: the key suffix its items take, and the model."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args and _model_of(args[0]):
        return "[]", _model_of(args[0])  # type: ignore[return-value]
    if origin is dict and len(args) == 2 and _model_of(args[1]):
        return ".<name>", _model_of(args[1])  # type: ignore[return-value]
    return None


def field_docs(model: type[BaseModel] = RunConfig, prefix: str = "") -> Iterator[FieldDoc]:
    """Every field, depth first in declaration order; a nested model contributes its own fields
    (``rl.lr``, ``reflection.judge.model``), a list or dict of models is one field followed by its items'
    fields (``data.queries[].path``, ``eval.graders.<name>.model``)."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        nested = _model_of(info.annotation)
        if nested is not None:
            yield from field_docs(nested, key + ".")
            continue
        yield FieldDoc(key, type_name(info.annotation), default_text(info), " ".join((info.description or "").split()))
        items = _items_model(info.annotation)
        if items is not None:
            yield from field_docs(items[1], key + items[0] + ".")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown() -> str:
    """The reference page: one table per top-level section, in RunConfig's order."""
    docs = list(field_docs())
    sections: dict[str, list[FieldDoc]] = {}
    for d in docs:
        sections.setdefault(d.key.split(".")[0] if "." in d.key else "(top level)", []).append(d)
    out = [
        "# Configuration reference",
        "",
        "Generated from `rubricem_core/config/` by `make docs`: every field of `RunConfig`, as "
        "`--set` and a profile's YAML name it. Profiles (`data/profiles/*.yaml`) change some defaults; "
        "`<run_dir>/config.yaml` holds a run's resolved values. How the sections fit together: "
        "[Configuration](../configuration.md).",
        "",
        f"{len(docs)} fields.",
        "",
    ]
    for section, rows in sections.items():
        out += [f"## {section}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for d in rows:
            default = d.default if len(d.default) <= 80 else d.default[:77] + "..."
            out.append(f"| `{d.key}` | `{_cell(d.type)}` | `{_cell(default)}` | {_cell(d.help)} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render_markdown(), end="")
