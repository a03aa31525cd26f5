"""The docs: the configuration reference is the code's (every field, and the committed page is current),
the README stays a landing page, and no relative link in the README or docs/ points at nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from rubricem_core.config import RunConfig
from rubricem_core.config_reference import field_docs, render_markdown, type_name

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _leaf_keys(model: BaseModel, prefix: str = "") -> set[str]:
    """An independent walk: the instance's own values, recursing into nested models only."""
    keys: set[str] = set()
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            keys |= _leaf_keys(value, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_the_reference_lists_every_field_of_the_run_config():
    documented = {d.key for d in field_docs()}
    missing = _leaf_keys(RunConfig()) - documented
    assert not missing, f"fields missing from the configuration reference: {sorted(missing)}"
    assert {"rl.lr", "reflection.judge.model", "data.world.n_queries", "data.queries[].path"} <= documented
    assert all(d.help for d in field_docs()), "every field has help text"


def test_the_committed_reference_is_current():
    page = REPO / "docs" / "reference" / "configuration.md"
    assert page.read_text(encoding="utf-8") == render_markdown(), (
        "docs/reference/configuration.md is stale: run `make docs` (or "
        "`.venv/bin/python -m rubricem_core.config_reference > docs/reference/configuration.md`)"
    )


@pytest.mark.parametrize(
    ("annotation", "shown"),
    [(int, "int"), (list[str], "list[str]"), (str | None, "str | null"), (dict[str, int], "dict[str, int]")],
)
def test_type_names_read_like_the_code(annotation, shown):
    assert type_name(annotation) == shown


def test_a_literal_shows_its_choices():
    doc = next(d for d in field_docs() if d.key == "rl.recipe")
    assert doc.type == '"baseline" | "ss_grpo" | "meta_policy" | "full"'


def test_the_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the reference belongs in docs/"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files(page: Path):
    broken = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)} links to missing files: {broken}"
