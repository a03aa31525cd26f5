"""One place for each concern (issue #22): table schemas (rubricem_core.schemas), run-directory paths
(rubricem_core.layout), NaN ↔ NULL of row values, and seed derivation (rubricem_core.seeds).

The contract columns below are DESIGN.md's "Columns that every reader may rely on"; the seed values are
worked by hand from the formulas the code used before the streams existed, so a run's figures stay the
same for the same seed."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rubricem_core import schemas, seeds
from rubricem_core.layout import RunLayout, final_checkpoint_dir, step_checkpoint_dir
from rubricem_core.schemas import nan_to_none, none_to_nan
from rubricem_core.seeds import derive_seed
from rubricem_core.store import RunStore

# DESIGN.md, "Storage": table → the columns every reader may rely on (tables may have more)
CONTRACT: dict[str, tuple[str, ...]] = {
    "queries": ("query_id",),
    "teacher_requests": ("request_id", "trajectory_id", "round", "model", "status"),
    "teacher_responses": (
        "request_id",
        "trajectory_id",
        "round",
        "model",
        "status",
        "response",
        "error",
        "prompt_tokens",
        "completion_tokens",
        "cost_usd",
    ),
    "sft_trajectories": ("trajectory_id", "query_id", "accepted", "reject_reasons", "n_tool_calls", "text"),
    "rollouts": (
        "step",
        "query_id",
        "rollout_id",
        "phase",
        "retrieval",
        "token_ids",
        "loss_mask",
        "stage_ids",
        "logprobs",
        "n_tool_calls",
        "finish_reason",
        "valid_scaffold",
        "judge_failed",
    ),
    "judge_rubrics": (
        "step",
        "query_id",
        "rubric_id",
        "stage",
        "polarity",
        "origin",
        "title",
        "description",
        "weight",
        "status",
        "created_step",
    ),
    "judge_scores": (
        "step",
        "query_id",
        "rollout_id",
        "rubric_id",
        "stage",
        "polarity",
        "weight",
        "score",
        "justification",
    ),
    "stage_rewards": ("step", "query_id", "rollout_id", "stage", "R", "G", "A"),
    "reflections": ("step", "query_id", "source_rollout_id", "candidate", "text", "valid", "score", "accepted"),
    "bank": ("query_id", "query_text", "reflection", "score", "step"),
    "metrics": ("step", "name", "value"),
    "eval_results": ("checkpoint", "benchmark", "query_id", "retrieval", "score", "details"),
}


# ---- schemas ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("table", sorted(CONTRACT))
def test_every_design_table_has_its_schema_with_the_contract_columns(table: str) -> None:
    schema = schemas.TABLE_SCHEMAS[table]
    assert isinstance(schema, pa.Schema)
    missing = [c for c in CONTRACT[table] if c not in schema.names]
    assert not missing, f"{table} lacks contract columns {missing}"


def test_list_columns_of_a_rollout_are_lists() -> None:
    for name in ("token_ids", "loss_mask", "stage_ids", "logprobs"):
        assert pa.types.is_list(schemas.ROLLOUTS_SCHEMA.field(name).type)
    assert pa.types.is_list(schemas.SFT_TRAJECTORIES_SCHEMA.field("reject_reasons").type)


def test_the_bank_table_and_the_saved_bank_share_one_schema() -> None:
    """tables/bank has the five contract columns (nullable); the saved bank's entries file has the same
    columns, never null, plus faiss_id: what both wrote before the schemas were merged."""
    assert schemas.BANK_SCHEMA.equals(
        pa.schema(
            [
                ("query_id", pa.string()),
                ("query_text", pa.string()),
                ("reflection", pa.string()),
                ("score", pa.float64()),
                ("step", pa.int64()),
            ]
        )
    )
    assert schemas.BANK_ENTRIES_SCHEMA.equals(
        pa.schema(
            [
                pa.field("query_id", pa.string(), nullable=False),
                pa.field("query_text", pa.string(), nullable=False),
                pa.field("reflection", pa.string(), nullable=False),
                pa.field("score", pa.float64(), nullable=False),
                pa.field("step", pa.int64(), nullable=False),
                pa.field("faiss_id", pa.int64(), nullable=False),
            ]
        )
    )


def test_the_old_import_places_give_the_one_schema() -> None:
    from rubricem_core import tracking
    from rubricem_core.eval import ablation
    from rubricem_core.eval import run as eval_run

    assert eval_run.EVAL_RESULTS_SCHEMA is schemas.EVAL_RESULTS_SCHEMA
    assert ablation.ABLATION_SCHEMA is schemas.ABLATION_SCHEMA
    assert tracking.METRICS_SCHEMA is schemas.METRICS_SCHEMA


def _one_row(schema: pa.Schema) -> dict[str, object]:
    """A row with a value of the right type in every column."""
    samples = {pa.string(): "x", pa.int64(): 3, pa.int8(): 1, pa.float64(): 0.5, pa.float32(): 0.25, pa.bool_(): True}
    out: dict[str, object] = {}
    for field in schema:
        if pa.types.is_list(field.type):
            item = field.type.value_type
            out[field.name] = [] if pa.types.is_struct(item) else [samples[item]]
        elif pa.types.is_timestamp(field.type):
            out[field.name] = None
        else:
            out[field.name] = samples[field.type]
    return out


@pytest.mark.parametrize("table", sorted(schemas.TABLE_SCHEMAS))
def test_every_registered_table_is_written_with_its_schema(tmp_path: Path, table: str) -> None:
    schema = schemas.TABLE_SCHEMAS[table]
    store = RunStore(tmp_path)
    store.write_table(table, [_one_row(schema)])  # no schema= : the registered one
    assert store.read_table(table).schema.remove_metadata().equals(schema)
    # a table with only some of the columns gets the others as nulls, in the schema's order
    first = schema.names[0]
    partial = pa.table({first: pa.array([_one_row(schema)[first]], schema.field(first).type)})
    required = [f.name for f in schema if not f.nullable and f.name != first]
    if required:  # queries, corpus: a column that may not be null cannot be left out
        with pytest.raises(ValueError, match=f"table {table!r}: column {required[0]!r} may not be null"):
            store.write_table(table, partial, part="p")
        return
    store.write_table(table, partial, part="p")
    assert store.read_table(table, {}, "p").schema.remove_metadata().equals(schema)


def test_a_table_without_a_registered_schema_is_refused(tmp_path: Path) -> None:
    from rubricem_core.store import TableSchemaError

    store = RunStore(tmp_path)
    with pytest.raises(ValueError, match="table 'scratch_notes' has no schema: register one"):
        store.write_table("scratch_notes", [{"x": 1}])
    with pytest.raises(TableSchemaError, match="'scratch_notes'"):
        store.write_table("scratch_notes", pa.table({"x": [1]}), schema=pa.schema([("x", pa.int64())]))
    assert not store.files("scratch_notes")


@pytest.mark.parametrize("as_table", [False, True])
def test_a_column_of_the_wrong_type_is_refused_naming_table_and_column(tmp_path: Path, as_table: bool) -> None:
    store = RunStore(tmp_path)
    rows = [{"step": 0, "query_id": "q", "rollout_id": "r", "score": "two"}]
    data = pa.Table.from_pylist(rows) if as_table else rows
    with pytest.raises(ValueError, match=r"table 'judge_scores': column 'score' .*int64"):
        store.write_table("judge_scores", data, {"step": 0})
    assert not store.files("judge_scores")


def test_a_table_with_columns_outside_the_schema_or_another_schema_is_refused(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    with pytest.raises(ValueError, match=r"table 'metrics': columns \['colour'\] are not in its schema"):
        store.write_table("metrics", pa.table({"step": [0], "colour": ["red"]}), {"step": 0})
    with pytest.raises(ValueError, match="table 'metrics': written with a schema other than its registered one"):
        store.write_table("metrics", [{"step": 0}], {"step": 0}, schema=schemas.BANK_SCHEMA)
    store.write_table("metrics", [{"step": 0, "name": "loss", "value": 1}], {"step": 0}, schema=schemas.METRICS_SCHEMA)
    assert store.read_rows("metrics")[0]["value"] == 1.0


def test_teacher_state_rows_round_trip_through_their_schema(tmp_path: Path) -> None:
    from rubricem_core.teacher.rounds import TrajectoryState

    state = TrajectoryState("q-t0", "q", 0, 7, [{"role": "user", "content": "why?"}], extra={"k": 1})
    store = RunStore(tmp_path)
    store.write_table("teacher_state", [dict(state.to_row(), round=0)], {"round": 0})
    row = store.read_rows("teacher_state", {"round": 0})[0]
    assert row["finish_reason"] is None and row["round"] == 0
    assert TrajectoryState.from_row(row) == state
    assert store.read_table("teacher_state").schema.remove_metadata().equals(schemas.TEACHER_STATE_SCHEMA)


# ---- NaN ↔ None ------------------------------------------------------------------------------------
def test_nan_to_none_and_back() -> None:
    assert nan_to_none(math.nan) is None and nan_to_none(None) is None
    assert nan_to_none(-1.25) == -1.25 and nan_to_none(0.0) == 0.0
    assert math.isnan(none_to_nan(None)) and none_to_nan(-3.5) == -3.5


def test_nan_is_null_in_a_table_and_nan_again_in_memory(tmp_path: Path) -> None:
    logprobs = [-0.5, math.nan, -2.0]
    store = RunStore(tmp_path)
    store.write_table("rollouts", [{"step": 0, "logprobs": [nan_to_none(x) for x in logprobs]}], {"step": 0})
    stored = store.read_rows("rollouts")[0]["logprobs"]
    assert stored == [-0.5, None, -2.0]
    back = [none_to_nan(x) for x in stored]
    assert back[0] == -0.5 and math.isnan(back[1]) and back[2] == -2.0


# ---- seeds -----------------------------------------------------------------------------------------
def test_seed_streams_reproduce_the_old_formulas_worked_by_hand() -> None:
    assert derive_seed(7, seeds.ROLLOUT, 3) == 700_024  # 7 * 100_003 + 3
    assert derive_seed(7, seeds.REFLECTION_SAMPLING, 4) == 700_137  # 7 * 100_019 + 4
    assert derive_seed(7, seeds.REFLECTION_SOURCE, 4) == 7_000_025  # 7 * 1_000_003 + 4
    assert derive_seed(7, seeds.TEACHER_TRAJECTORY, 2, 1) == 7_000_224  # 7 * 1_000_003 + 2 * 101 + 1
    # 5000 * 1_000_003 = 5_000_015_000 ≥ 2**31 - 1: minus 2 × 2_147_483_647
    assert derive_seed(5000, seeds.TEACHER_TRAJECTORY, 0, 0) == 705_047_706
    assert derive_seed(7_000_224, seeds.TEACHER_REQUEST, 3) == 7_000_227  # trajectory seed + round
    assert derive_seed(7, seeds.TEACHER_TURN, 2) == 55_435  # 7 * 7919 + 2
    assert derive_seed(7, seeds.SFT_REFLECTION_MIX, 2) == 55_435  # 7 * 7_919 + 2
    assert derive_seed(7, seeds.SFT_EPOCH, 2) == 9  # 7 + 2
    assert derive_seed(7, seeds.SFT_GUIDED, 0) == 55_489  # 7 * 7_927
    assert derive_seed(7, seeds.TEACHER_REFLECTION_CUTS, 3) == 7_000_234  # 7 * 1_000_033 + 3
    assert derive_seed(7, seeds.TEACHER_REFLECTION_REQUEST, 3, 2) == 7_000_281  # 7 * 1_000_033 + 3 * 16 + 2
    # a name counts as its CRC-32: crc32(b"synthetic") = 1_103_364_695
    assert zlib.crc32(b"synthetic") == 1_103_364_695
    assert derive_seed(7, seeds.EVAL_SAMPLING, "synthetic") == 7 * 100_003 + 1_103_364_695
    assert derive_seed(7, seeds.EVAL_REFLECTION, "sft--synthetic--none") == 7 * 100_019 + 551_322_257


@pytest.mark.parametrize("seed", [0, 1, 13, 2**31 - 1, 10**12])
def test_seed_streams_equal_the_old_formulas_on_a_grid(seed: int) -> None:
    for step in (0, 1, 5, 999):
        assert derive_seed(seed, seeds.ROLLOUT, step) == seed * 100_003 + step
        assert derive_seed(seed, seeds.REFLECTION_SAMPLING, step) == seed * 100_019 + step
        assert derive_seed(seed, seeds.REFLECTION_SOURCE, step) == seed * 1_000_003 + step
        assert derive_seed(seed, seeds.SFT_REFLECTION_MIX, step) == seed * 7_919 + step
        assert derive_seed(seed, seeds.TEACHER_TURN, step) == seed * 7919 + step
        assert derive_seed(seed, seeds.SFT_EPOCH, step) == seed + step
        assert derive_seed(seed, seeds.TEACHER_REQUEST, step) == seed + step
        for s in (0, 3):
            assert derive_seed(seed, seeds.TEACHER_TRAJECTORY, step, s) == (seed * 1_000_003 + step * 101 + s) % (
                2**31 - 1
            )
            assert derive_seed(seed, seeds.TEACHER_REFLECTION_REQUEST, step, s) == seed * 1_000_033 + step * 16 + s
    for name in ("synthetic", "healthbench", "rl-step-000003--synthetic--cross"):
        assert derive_seed(seed, seeds.EVAL_SAMPLING, name) == seed * 100_003 + zlib.crc32(name.encode())
        assert derive_seed(seed, seeds.EVAL_REFLECTION, name) == seed * 100_019 + zlib.crc32(name.encode())


def test_a_stream_takes_its_number_of_parts_and_says_why_it_exists() -> None:
    with pytest.raises(ValueError, match="teacher_trajectory"):
        derive_seed(1, seeds.TEACHER_TRAJECTORY, 3)
    assert all(stream.why for stream in seeds.STREAMS.values())


def test_teacher_rounds_use_the_streams() -> None:
    from rubricem_core.teacher.rounds import build_requests, initial_states

    queries = [{"query_id": f"q{i}", "question": f"question {i}?"} for i in range(3)]
    states = initial_states(queries, 2, seed=5000)
    assert [s.seed for s in states] == [
        (5000 * 1_000_003 + qi * 101 + s) % (2**31 - 1) for qi in range(3) for s in range(2)
    ]
    requests = build_requests(states, 2, "m", 16, 0.0)
    assert [r.seed for r in requests] == [s.seed + 2 for s in states]


# ---- layout ----------------------------------------------------------------------------------------
def test_layout_paths_spelled_out() -> None:
    run = RunLayout("runs/x")
    r = Path("runs/x")
    assert run.config_file == r / "config.yaml" and run.lock_file == r / ".rubricem.lock"
    assert run.table_dir("rollouts") == r / "tables" / "rollouts"
    assert run.bank_dir == r / "state" / "bank"
    assert run.task_metrics_file("rollout", 3) == r / "state" / "task_metrics" / "rollout-0003.json"
    assert run.rl_progress_file == r / "state" / "rl_progress.json"
    assert run.batch_marker("teacher_round_0002") == r / "state" / "teacher_round_0002.json"
    assert run.rank_logs_dir == r / "state" / "ranks"
    assert run.prefect_server_log == r / "state" / "prefect-server.log"
    assert run.mlflow_db == r / "mlflow" / "mlflow.db" and run.mlflow_artifacts_dir == r / "mlflow" / "artifacts"
    assert run.policy_base_dir == run.policy_dir / "base" == r / "policy" / "base"
    assert run.sft_final == r / "checkpoints" / "sft" / "final"
    assert step_checkpoint_dir(run.sft_checkpoints_dir, 40) == r / "checkpoints" / "sft" / "step-000040"
    assert final_checkpoint_dir(run.rl_checkpoints_dir) == r / "checkpoints" / "rl" / "final"
    assert run.rl_step_checkpoint(3) == r / "checkpoints" / "rl" / "step-000003"
    assert run.report_html == r / "report" / "report.html"
    assert (
        run.ablation_run_dir("full") == r / "ablation" / "full" and run.ablation_plot == r / "ablation" / "ablation.png"
    )


def test_has_sft_policy_looks_for_the_checkpoint_config(tmp_path: Path) -> None:
    run = RunLayout(tmp_path)
    assert not run.has_sft_policy()
    run.sft_final.mkdir(parents=True)
    assert not run.has_sft_policy()  # a directory without a loadable checkpoint
    (run.sft_final / "config.json").write_text("{}")
    assert run.has_sft_policy()


def test_layout_matches_what_the_store_writes(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    run = RunLayout(tmp_path.resolve())
    path = store.write_table("rollouts", [{"step": 3}], {"step": 3})
    assert path == run.table_dir("rollouts") / "step=0003" / "part.parquet"
    assert store.tables_dir == run.tables_dir and store.state_dir == run.state_dir and store.layout.root == run.root


def test_layout_matches_the_bank_and_its_saved_schema(tmp_path: Path) -> None:
    from rubricem_core.embedders import HashingEmbedder
    from rubricem_core.reflection.bank import ENTRIES_FILE, BankEntry, ReflectionBank, bank_dir

    assert bank_dir(tmp_path) == RunLayout(tmp_path.resolve()).bank_dir == tmp_path.resolve() / "state" / "bank"
    bank = ReflectionBank(HashingEmbedder(32))
    bank.add(BankEntry("q1", "what is x?", "look at x", 0.5, 0))
    saved = bank.save(bank_dir(tmp_path))
    assert pq.read_schema(saved / ENTRIES_FILE).remove_metadata().equals(schemas.BANK_ENTRIES_SCHEMA)
    RunStore(tmp_path).write_table("bank", bank.rows(), schema=schemas.BANK_SCHEMA)
    assert RunStore(tmp_path).read_table("bank").schema.equals(schemas.BANK_SCHEMA)
    assert ReflectionBank.load(saved).get("q1").reflection == "look at x"


def test_layout_matches_config_lock_tracking_and_checkpoint_tags(tmp_path: Path) -> None:
    from rubricem_core.config import load_config
    from rubricem_core.eval.checkpoints import checkpoint_tag
    from rubricem_core.run_config import record_config
    from rubricem_core.runlock import lock_path, run_dir_lock
    from rubricem_core.tracking import Tracker

    run = RunLayout(tmp_path)
    cfg = load_config("tiny", {})
    record_config(tmp_path, cfg, "test")
    assert run.config_file.is_file()
    changed = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"experiment": "other"})})
    assert record_config(tmp_path, changed, "test")
    assert run.config_revisions_file.is_file()
    with run_dir_lock(tmp_path, "test"):
        assert lock_path(tmp_path) == run.lock_file and run.lock_file.exists()
    tracker = Tracker(tmp_path)
    resolved = RunLayout(tmp_path.resolve())
    assert tracker.db_path == resolved.mlflow_db and tracker.state_path == resolved.tracking_state_file
    assert checkpoint_tag(tmp_path, run.sft_final) == "sft"
    assert checkpoint_tag(tmp_path, run.rl_step_checkpoint(3)) == "rl-step-000003"
