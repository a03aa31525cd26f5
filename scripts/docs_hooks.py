"""mkdocs hook (mkdocs.yml): the site's home page is README.md with its links made site-relative, not a
second copy that can drift."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def readme_as_home(text: str) -> str:
    """README's links point into docs/ from the repository root; the site serves docs/ as its root."""
    return re.sub(r"\]\(docs/", "](", text)


def on_files(files: Files, config: Any) -> Files:
    home = readme_as_home((ROOT / "README.md").read_text(encoding="utf-8"))
    files.append(File.generated(config, "index.md", content=home))
    return files
