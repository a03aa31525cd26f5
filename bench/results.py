"""The benchmarks' results file (``bench/results.jsonl``) and the docs page written from it.

``bench/run_all.py`` appends one JSON line per figure it parses: the figure (name, value, unit, goal, met),
the script and its seconds, whether ``--quick`` sizes were used, and when, at which commit and on which
machine it was measured. ``python -m bench.results`` writes ``docs/benchmarks.md``: the newest line of every
figure and size, so a number quoted in the docs has a dated, reproducible source; ``--check`` exits 1 when
the committed page differs from the file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results.jsonl"
PAGE = REPO_ROOT / "docs" / "benchmarks.md"
# how a docs page cites a figure: `name` in [benchmarks](benchmarks.md), across a line break too
CITATION = re.compile(r"`([A-Za-z0-9_.\-/]+)`\s+in\s+\[benchmarks\]\(benchmarks\.md\)")
# a script's figure name as written in its figure_line call or figure line; {…} parts (a recipe) match any word
PRINTED = re.compile(r'figure_line\(\s*f?"([^"]+)"|figure: ([A-Za-z0-9_.\-/{}]+)=')


def machine() -> str:
    """What the numbers were measured on, in words: CPUs, memory, GPU."""
    cpus = os.cpu_count() or 0
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f", {pages / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{cpus} CPUs{memory}, {gpu}, {platform.machine()}"


def commit() -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes), or ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def append_result(path: Path, script: str, figure: Any, seconds: float, quick: bool, note: str = "") -> dict[str, Any]:
    """One line for ``figure`` (a ``run_all.Figure``) at the end of ``path``."""
    line = {
        "name": figure.name,
        "value": figure.value,
        "unit": figure.unit,
        "goal": figure.goal,
        "met": figure.met,
        "script": script,
        "seconds": round(seconds, 1),
        "quick": quick,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine(),
        "note": note,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    return line


def read_results(path: Path = RESULTS) -> list[dict[str, Any]]:
    """Every line, oldest first; a line that is not a figure is refused with its number."""
    rows = []
    if not path.is_file():
        return rows
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        missing = [k for k in ("name", "value", "goal", "met", "script", "date", "commit", "machine") if k not in row]
        if missing:
            raise ValueError(f"{path}:{number}: missing {', '.join(missing)}")
        rows.append(row)
    return rows


def newest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest line of each (figure, size), in the order the figures first appeared."""
    latest: dict[tuple[str, bool], dict[str, Any]] = {}
    for row in rows:
        latest[(row["name"], bool(row.get("quick")))] = row
    return list(latest.values())


def _value(row: dict[str, Any]) -> str:
    value = row["value"]
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return f"{text} {row['unit']}".strip() if row.get("unit") else text


def cited_figures(docs_dir: Path = PAGE.parent) -> dict[str, list[str]]:
    """Every figure a docs page cites, with the pages that cite it."""
    cited: dict[str, list[str]] = {}
    for page in sorted(docs_dir.rglob("*.md")):
        for name in CITATION.findall(page.read_text(encoding="utf-8")):
            pages = cited.setdefault(name, [])
            if page.name not in pages:
                pages.append(page.name)
    return cited


def printing_script(name: str, bench_dir: Path = BENCH_DIR) -> str | None:
    """The bench script that prints figure ``name`` (None: no script does)."""
    for script in sorted(bench_dir.glob("*.py")):
        for called, literal in PRINTED.findall(script.read_text(encoding="utf-8")):
            written = called or literal
            if not re.sub(r"\{[^}]*\}", "", written):
                continue  # a name that is all placeholder (run_all's own formatter)
            pattern = "".join(
                "[A-Za-z0-9_]+" if part.startswith("{") else re.escape(part)
                for part in re.split(r"(\{[^}]*\})", written)
                if part
            )
            if re.fullmatch(pattern, name):
                return script.stem
    return None


def render_page(rows: list[dict[str, Any]], cited: dict[str, list[str]] | None = None) -> str:
    met = {True: "yes", False: "**no**", None: "n/a"}
    lines = [
        "# Benchmarks",
        "",
        "Written by `python -m bench.results` from `bench/results.jsonl`, which `bench/run_all.py` appends to:",
        "the newest measurement of every figure, with its date, commit and machine. Timings come from shared",
        "machines and vary from run to run; `quick` rows used the scripts' small sizes. What each script",
        "measures and how is in `bench/README.md` and the script's own docstring.",
        "",
    ]
    if not rows:
        return "\n".join([*lines, "No measurement yet: `.venv/bin/python bench/run_all.py --quick`.", ""])
    lines += [
        "| figure | value | goal | met | script | size | seconds | date | commit | machine | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in newest(rows):
        size = "quick" if row.get("quick") else "full"
        lines.append(
            f"| `{row['name']}` | {_value(row)} | {row['goal']} | {met.get(row['met'], row['met'])} | "
            f"`{row['script']}` | {size} | {row.get('seconds', '')} | {row['date']} | `{row['commit']}` | "
            f"{row['machine']} | {row.get('note') or ''} |"
        )
    unmeasured = {name: pages for name, pages in (cited or {}).items() if name not in {r["name"] for r in rows}}
    if unmeasured:
        lines += [
            "",
            "## Cited in the docs, not in the results file yet",
            "",
            "These figures were measured before the results file began, and their old numbers were taken out of",
            "the pages that cite them; `.venv/bin/python bench/run_all.py --only <script>` measures one.",
            "",
            "| figure | script | cited in |",
            "|---|---|---|",
        ]
        for name, pages in sorted(unmeasured.items()):
            script = printing_script(name)
            lines.append(f"| `{name}` | {f'`{script}`' if script else '?'} | {', '.join(pages)} |")
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md is not current")
    args = parser.parse_args(argv)
    page = render_page(read_results(), cited_figures())
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.is_file() else ""
        if current != page:
            print(f"{PAGE} is not current: python -m bench.results", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE} ({len(newest(read_results()))} figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
