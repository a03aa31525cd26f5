"""`make run` then `make test` is safe: no test reads the checkout's runs/ (what `make run` writes), so a
finished (or half-finished) runs/tiny cannot change any test's outcome. Tests that need a finished run
take the ``tiny_pipeline_run`` fixture (tests/conftest.py), built under pytest's tmp dir."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# A path into the checkout's runs/: runs joined to the repo root (REPO / "runs", REPO_ROOT / 'runs',
# Path(__file__).parents[1] / "runs", ....parent / "runs") or the `make run` directory as a string
# literal ("runs/tiny", './runs/tiny'); prose that mentions runs/tiny is not a path.
CHECKOUT_RUNS = (
    re.compile(r"""\b\w*(?:REPO|ROOT)\w*\s*/\s*["']runs\b"""),
    re.compile(r"""(?:\bparents\[\d+\]|\.parent)\s*/\s*["']runs\b"""),
    re.compile(r"""["'](?:\./)?runs/tiny\b"""),
)


def checkout_runs_references(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in CHECKOUT_RUNS)]


@pytest.mark.parametrize(
    "line",
    [
        'TINY_RUN = REPO / "runs" / "tiny"',
        'part = sorted((REPO_ROOT / "runs" / "tiny" / "tables" / "judge_scores").glob("*"))',
        "run = Path(__file__).resolve().parents[1] / 'runs' / 'small'",
        'run = HERE.parent / "runs"',
        'subprocess.run(["rubricem", "report", "--run-dir", "./runs/tiny"])',
    ],
)
def test_the_patterns_catch_the_checkouts_runs(line: str) -> None:
    assert checkout_runs_references(line)


@pytest.mark.parametrize(
    "line",
    [
        'run_dir = base / "runs" / "a"',  # under a tmp dir
        'run = RunLayout("runs/x")',  # path arithmetic, nothing read
        'assert deployment["parameters"] == {"run_dir": "runs/ui", "profile": "tiny"}',
        'text = pipeline_summary(result, "tiny", "runs/t")',
        'url = "http://127.0.0.1:4200/runs/flow-run/4f1c"',
        'VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"',
        'str(REPO_ROOT / "bench" / "duckdb_latency.py")',
        '"""built by the session, never the checkout runs/tiny"""',  # prose
    ],
)
def test_the_patterns_leave_other_paths_alone(line: str) -> None:
    assert not checkout_runs_references(line)


def test_no_test_reads_the_checkouts_runs() -> None:
    modules = sorted(p for p in TESTS.rglob("*.py") if p.resolve() != Path(__file__).resolve())
    assert len(modules) > 50 and TESTS / "conftest.py" in modules
    found = {
        str(p.relative_to(TESTS)): hits
        for p in modules
        if (hits := checkout_runs_references(p.read_text(encoding="utf-8")))
    }
    assert not found, f"tests that read the checkout's runs/ (build the run under tmp_path instead): {found}"
