"""The ablation's recipe runs start from the parent run's inputs — including the teacher's reflections,
which warm the reflection bank of `full` and `meta_policy` (issue #33: without them the sub run's bank
started empty whatever reflection.warm_bank said)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rubricem_core.rl.session import warm_bank_entries
from rubricem_core.store import RunStore

REFLECTION = (
    "<reflection>\n<reflection_rubrics>\n- States the founding year of Acme Works\n</reflection_rubrics>\n"
    "<takeaways>\n- Search for Acme Works founding year\n</takeaways>\n</reflection>"
)


def _parent(root: Path, teacher: bool) -> str:
    def table(name: str, rows: dict[str, list]) -> None:
        (root / "tables" / name).mkdir(parents=True)
        pq.write_table(pa.table(rows), root / "tables" / name / "part.parquet")

    table("queries", {"query_id": ["q1"], "question": ["When was Acme Works founded?"]})
    table("corpus", {"doc_id": ["D1"], "text": ["Acme Works was founded in 1901."]})
    if teacher:
        table(
            "teacher_reflections",
            {"request_id": ["t1-reflection"], "query_id": ["q1"], "valid": [True], "text": [REFLECTION]},
        )
    final = root / "checkpoints" / "sft" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    return str(root)


@pytest.mark.parametrize("teacher", [True, False])
def test_a_recipe_run_gets_the_teacher_reflections_that_warm_its_bank(tmp_path, teacher):
    from flows.ablation import prepare_recipe_run

    parent = _parent(tmp_path / "run", teacher)
    sub = prepare_recipe_run(parent, "full")
    assert (Path(sub) / "tables" / "queries").is_dir() and (Path(sub) / "checkpoints" / "sft" / "final").is_dir()
    entries = warm_bank_entries(RunStore(sub), 0.0)
    assert [(e.query_id, e.reflection) for e in entries] == ([("q1", REFLECTION)] if teacher else [])
    assert prepare_recipe_run(parent, "full") == sub  # a rerun keeps what is there
