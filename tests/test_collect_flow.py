"""The collect_sft_data flow end to end: built-in teacher (litellm provider), the Batch API path
against a fake OpenAI server on 127.0.0.1, and resume after a failure injected in round 2."""

from __future__ import annotations

import json

import pytest

from flows.collect_sft_data import collect_sft_data
from rubricem_core.sim.teacher import ScriptedTeacher, TeacherRates
from rubricem_core.sql import run_sql
from rubricem_core.store import RunStore

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]  # flows end to end

SMALL = {
    "data.world.n_documents": 120,
    "data.world.n_queries": 10,
    "data.world.eval_fraction": 0.2,
    "teacher.trajectories_per_query": 2,
}


def test_tiny_flow_writes_tables_sql_and_mlflow(tmp_path):
    run_dir = str(tmp_path / "run")
    result = collect_sft_data(run_dir=run_dir, profile="tiny", overrides=SMALL)
    store = RunStore(run_dir)
    for table in ("queries", "corpus", "teacher_requests", "teacher_responses", "sft_trajectories", "metrics"):
        assert store.files(table), table
    rows = json.loads(run_sql(run_dir, "SELECT accepted, count(*) AS n FROM sft_trajectories GROUP BY ALL", fmt="json"))
    counts = {r["accepted"]: r["n"] for r in rows}
    assert sum(counts.values()) == result["trajectories"] == 8 * 2
    assert counts.get(True, 0) >= 8, counts
    # requests and responses line up, one per round per unfinished trajectory, all with usage
    joined = json.loads(
        run_sql(
            run_dir,
            """
        SELECT count(*) AS n, count(r.request_id) AS matched, sum(r.prompt_tokens) AS pt
        FROM teacher_requests q LEFT JOIN teacher_responses r USING (request_id)""",
            fmt="json",
        )
    )[0]
    assert joined["n"] == joined["matched"] > 16 and joined["pt"] > 0
    # partitioned by round, every file whole
    assert store.partitions("teacher_requests", "round")[0] == 0
    assert (tmp_path / "run" / "mlflow" / "mlflow.db").exists()
    metrics = json.loads(run_sql(run_dir, "SELECT name, value FROM metrics WHERE name = 'sft/accepted'", fmt="json"))
    assert metrics and metrics[0]["value"] == counts.get(True, 0)

    # a second run of the same flow on the same run dir recomputes nothing
    again = collect_sft_data(run_dir=run_dir, profile="tiny", overrides=SMALL)
    assert again["accepted"] == result["accepted"]


def test_rejected_rows_say_why(tmp_path):
    run_dir = str(tmp_path / "run")
    collect_sft_data(
        run_dir=run_dir,
        profile="tiny",
        overrides={**SMALL, "teacher.uncited_rate": 0.5, "teacher.ungrounded_rate": 0.3},
    )
    reasons = json.loads(
        run_sql(
            run_dir,
            """
        SELECT reason, count(*) AS n FROM (SELECT unnest(reject_reasons) AS reason FROM sft_trajectories)
        GROUP BY ALL""",
            fmt="json",
        )
    )
    codes = {r["reason"] for r in reasons}
    assert {"uncited_answer", "ungrounded_citation"} <= codes


@pytest.fixture()
def fake_provider(monkeypatch):
    from rubricem_core.testing.openai_server import FakeOpenAIServer

    teacher = ScriptedTeacher(TeacherRates(max_tool_calls=10))
    monkeypatch.setenv("FAKE_PROVIDER_KEY", "sk-fake-test-key")
    with FakeOpenAIServer(respond=lambda body: teacher.respond(body["messages"], body), polls_in_progress=1) as server:
        yield server


def batch_overrides(server) -> dict:
    return {
        **SMALL,
        "teacher.model": "openai/frontier-teacher",
        "teacher.mode": "batch",
        "teacher.api_base": server.base_url,
        "teacher.api_key_env": "FAKE_PROVIDER_KEY",
        "teacher.batch_poll_interval_s": 0.05,
        "teacher.batch_poll_max_interval_s": 0.1,
        "teacher.max_retries": 1,
    }


def test_batch_api_path_with_partial_failure(tmp_path, fake_provider):
    # the first request of round 1 fails once inside its batch and is resubmitted alone
    fake_provider.fail_times = {"syn-00000-t0:r01": 1}
    run_dir = str(tmp_path / "run")
    result = collect_sft_data(run_dir=run_dir, profile="tiny", overrides=batch_overrides(fake_provider))
    assert result["accepted"] > 0
    per_batch = fake_provider.batch_custom_ids()
    assert len(per_batch) >= 3  # one batch per round, plus the resubmission
    assert ["syn-00000-t0:r01"] in per_batch
    statuses = json.loads(
        run_sql(run_dir, "SELECT status, count(*) AS n FROM teacher_responses GROUP BY ALL", fmt="json")
    )
    assert {r["status"] for r in statuses} == {"ok"}
    # the key never lands in a table
    for path in RunStore(run_dir).tables_dir.rglob("*.parquet"):
        assert b"sk-fake-test-key" not in path.read_bytes()


def test_resume_after_failure_in_round_2_does_not_rerequest(tmp_path, fake_provider, monkeypatch):
    import rubricem_core.teacher.collection as collection

    real_apply = collection.apply_result

    def crash_in_round_2(state, result, run_tool, round_index, *args):
        if round_index == 2:
            raise RuntimeError("injected failure in round 2")
        return real_apply(state, result, run_tool, round_index, *args)

    run_dir = str(tmp_path / "run")
    overrides = batch_overrides(fake_provider)
    monkeypatch.setattr(collection, "apply_result", crash_in_round_2)
    with pytest.raises(RuntimeError, match="injected failure"):
        collect_sft_data(run_dir=run_dir, profile="tiny", overrides=overrides)
    store = RunStore(run_dir)
    assert store.partitions("teacher_state", "round") == [0, 1]
    uploaded_before = [line["custom_id"] for line in fake_provider.uploaded_lines]

    monkeypatch.setattr(collection, "apply_result", real_apply)
    state = collect_sft_data(run_dir=run_dir, profile="tiny", overrides=overrides, return_state=True)
    result = state.result()
    # the rerun reads the finished rounds back (Prefect's Cached state); the round that failed is
    # computed again, never reported Cached
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    states = {t.name: t.state.name for t in tasks}
    assert states["teacher-round-0"] == states["teacher-round-1"] == "Cached", states
    assert states["teacher-round-2"] == "Completed" and states["prepare-inputs"] == "Cached", states
    assert (
        "read back from tables/teacher_state/round=0001" in {t.name: t.state.message for t in tasks}["teacher-round-1"]
    )
    uploaded_after = [line["custom_id"] for line in fake_provider.uploaded_lines][len(uploaded_before) :]
    assert not any(cid.endswith((":r00", ":r01", ":r02")) for cid in uploaded_after), "completed rounds re-requested"
    assert result["trajectories"] == 16
    # every request id appears once in the responses table
    dupes = json.loads(
        run_sql(run_dir, "SELECT request_id FROM teacher_responses GROUP BY 1 HAVING count(*) > 1", fmt="json")
    )
    assert dupes == []


def test_teacher_reflections_through_the_batch_api_and_a_rerun_retries_only_the_failed(tmp_path, fake_provider):
    """After filtering, the teacher writes one reflection per accepted trajectory, in the meta-policy's
    prompt and format, through the same Batch API; a reflection whose call failed is asked again by the
    rerun, and only it."""
    from rubricem_core.reflection.format import REFLECTION_SYSTEM, validate_reflection

    run_dir = str(tmp_path / "run")
    overrides = batch_overrides(fake_provider)
    # every first trajectory's reflection fails in its batch and both resubmissions
    fake_provider.fail_times = {f"syn-{i:05d}-t0-reflection": 3 for i in range(10)}
    result = collect_sft_data(run_dir=run_dir, profile="tiny", overrides=overrides)
    store = RunStore(run_dir)
    rows = store.read_rows("teacher_reflections")
    accepted = [r for r in store.read_rows("sft_trajectories") if r["accepted"]]
    # each accepted trajectory whole and one prefix of it (teacher.reflection_prefixes: 1)
    assert sorted(r["request_id"] for r in rows) == sorted(
        f"{r['trajectory_id']}-reflection{s}" for r in accepted for s in ("", "-p1")
    )
    failed = sorted(r["request_id"] for r in rows if r["status"] != "ok")
    assert failed and all(r.endswith("-t0-reflection") for r in failed)
    assert all(r["reject_codes"] == ["request_failed"] and not r["valid"] for r in rows if r["status"] != "ok")
    assert result["reflections_valid"] == len(rows) - len(failed) > 0
    for row in rows:
        messages = json.loads(row["messages"])
        assert messages[0] == {"role": "system", "content": REFLECTION_SYSTEM}  # the meta-policy's prompt
        if row["valid"]:
            question = next(q["question"] for q in store.read_rows("queries") if q["query_id"] == row["query_id"])
            assert validate_reflection(row["text"], question=question) == []
    uploaded = len(fake_provider.uploaded_lines)
    again = collect_sft_data(run_dir=run_dir, profile="tiny", overrides=overrides)
    new = sorted(line["custom_id"] for line in fake_provider.uploaded_lines[uploaded:])
    assert new == failed, new  # only the failed calls are asked again
    assert again["reflections_valid"] == len(rows)
    assert all(r["valid"] for r in store.read_rows("teacher_reflections"))


def test_a_teacher_outage_fails_the_round_and_the_rerun_sends_only_the_failed_requests(tmp_path, fake_provider):
    """Most of round 0's requests fail (after retries and resubmissions): the flow fails naming them, the
    round is not marked done; with the endpoint back the rerun sends only those requests and ends with
    the tables of a collection that never saw the outage."""
    import tasks.collect as collect_tasks

    overrides = batch_overrides(fake_provider)
    ref_dir = str(tmp_path / "ref")
    collect_sft_data(run_dir=ref_dir, profile="tiny", overrides=overrides)
    run_dir = str(tmp_path / "run")
    down = {f"syn-{i:05d}-t{t}:r00" for i in range(7) for t in range(2)}
    fake_provider.fail_custom_ids = set(down)
    with pytest.raises(collect_tasks.TeacherRoundError, match=r"round 0: \d+ of 16 teacher requests failed"):
        collect_sft_data(run_dir=run_dir, profile="tiny", overrides=overrides)
    store = RunStore(run_dir)
    assert not store.partitions("teacher_state", "round") and not store.files("sft_trajectories")
    failed = sorted(r["request_id"] for r in store.read_rows("teacher_responses", {"round": 0}) if r["status"] != "ok")
    assert failed and set(failed) <= down
    fake_provider.fail_custom_ids = set()  # the endpoint is back
    uploaded = len(fake_provider.uploaded_lines)
    collect_sft_data(run_dir=run_dir, profile="tiny", overrides=overrides)
    resent = sorted(
        line["custom_id"] for line in fake_provider.uploaded_lines[uploaded:] if line["custom_id"].endswith(":r00")
    )
    assert resent == failed, "round 0's answered requests were sent (and paid for) twice"

    def texts(d):
        return sorted((r["trajectory_id"], r["accepted"], r["text"]) for r in RunStore(d).read_rows("sft_trajectories"))

    assert texts(run_dir) == texts(ref_dir)
