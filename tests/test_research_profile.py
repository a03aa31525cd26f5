"""The research profiles' code path end to end, offline (issue #20), on `research-drtulu` (DR Tulu's choices:
the Batch API teacher and Serper; the paper's `research` differs in its models and its search tool, whose
wire formats tests/test_tools_gemini_search.py and tests/test_research_paper_profile.py cover).

data/profiles/research-drtulu.yaml as it is — query files in DR Tulu format (train and eval splits), Serper /
Semantic Scholar / browse tools behind the on-disk tool cache, a teacher on the Batch API, an LLM judge
that never sees the answer key (judge.show_reference: false, the paper's rubric ranges), the reflection
loop of recipe full with per-candidate reflection judging and within_source: window, seeded random eval
samples — with only what a CPU cannot run swapped out: the tiny random-init policy, the torch trainers
(no DeepSpeed, no sharded reference, one rank, fp32), the transformers rollout engine, small sizes, and
the hashing embedder for the bank (no Qwen3-Embedding offline).

Every remote endpoint is a fake server on 127.0.0.1 reached over real HTTP: the teacher (Batch API,
answered by the scripted teacher), the judge (the built-in judge's logic), the reflection judge (the
built-in reflection judge's), the benchmark grader (the built-in grader's) and a Serper-shaped search
API whose organic results are BM25 hits over a synthetic world's corpus, so the teacher finds its facts
through web snippets (W-hash ids) and browses the pages they link to.

The tiny policy after two SFT steps writes no valid reflection, so even reflection candidates are forced
through the engine's test hook (rubricem_core/testing/forced_reflections.py) to give the reflection judge work.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rubricem_core.config import PROFILES_DIR
from rubricem_core.sim.grader import respond as builtin_grader_reply
from rubricem_core.sim.judge import respond as builtin_judge_reply
from rubricem_core.sim.reflection_judge import respond as builtin_reflection_judge_reply
from rubricem_core.sim.teacher import ScriptedTeacher, TeacherRates
from rubricem_core.sim.world import WorldConfig, generate_world
from rubricem_core.sql import run_sql
from rubricem_core.testing.forced_reflections import forcing_engine
from rubricem_core.testing.openai_server import FakeOpenAIServer
from rubricem_core.testing.web_search_server import FakeWebSearchServer
from rubricem_core.tools.cache import ToolCache

pytestmark = pytest.mark.slow  # runs flows end to end; `make test-fast` leaves it out
PROFILE = "research-drtulu"

# comparison and two-hop questions: two searches each, as research's filter.min_tool_calls asks
WORLD = WorldConfig(seed=0, n_documents=80, n_queries=8, eval_fraction=0.25, query_kinds=["comparison", "multi_hop"])
RETRIEVAL_MODES = ("none", "cross", "within", "sequential")
RESEARCH_BENCHMARKS = ("researchqa", "researchrubrics")
KEYS = {
    name: f"sk-{name.lower()}-{secrets.token_hex(8)}"
    for name in ("TEACHER", "JUDGE", "REFLECT", "GRADER", "GRADER2", "SERPER", "S2")
}


def _env(name: str) -> str:
    return f"RUBRICEM_RP_{name}_KEY"


def _serve(respond: Any, name: str) -> FakeOpenAIServer:
    """An OpenAI-compatible fake answering with ``respond(messages, body)``, demanding its own key."""
    return FakeOpenAIServer(lambda body: respond(body["messages"], body), api_key=KEYS[name])


def _dr_tulu_row(query: Any, marker: str) -> dict[str, Any]:
    """A DR Tulu RL row: the chat, and ground_truth with plain rubrics (no `check`: an LLM judge reads the
    words) and an answer that carries ``marker``, so a judge prompt that showed the answer key is found."""
    rubrics = [
        {
            "title": r["title"],
            "description": r["description"],
            "weight": -r["weight"] if r["polarity"] == "negative" else r["weight"],
        }
        for r in query.rubrics
    ]
    truth = {"query": query.question, "rubrics": rubrics, "answer": f"{query.reference_answer} [{marker}]"}
    return {
        "id": query.query_id.replace("syn-", "q"),
        "dataset": "synthetic_world",
        "messages": [{"role": "user", "content": query.question}],
        "ground_truth": json.dumps(truth),
    }


def _overview_rows(world: Any, marker: str, n: int = 2) -> list[dict[str, Any]]:
    """Questions outside the synthetic world's question forms: the scripted teacher answers them with its
    generic strategy (search the question, browse the best hit, answer from what it read), which exercises
    the web browse tool on the ids the web search returned."""
    rows = []
    for org in [o for o in world.organizations if not o.is_distractor][:n]:
        name = org.name
        question = f"Give a short overview of {name}: who founded it, when, and where it is headquartered."
        rubrics = [
            {
                "title": f"Names the founder of {name}",
                "description": f"States that {org.founder} founded {name}.",
                "weight": 2,
            },
            {
                "title": "Gives the founding year",
                "description": f"States that {name} was founded in {org.founded}.",
                "weight": 2,
            },
            {
                "title": "Gives the headquarters",
                "description": f"States that {name} is based in {org.headquarters}.",
                "weight": 1,
            },
        ]
        answer = f"{name} was founded in {org.founded} by {org.founder}; it is based in {org.headquarters}. [{marker}]"
        rows.append(
            {
                "id": f"overview{len(rows)}",
                "dataset": "synthetic_world",
                "messages": [{"role": "user", "content": question}],
                "ground_truth": json.dumps({"query": question, "rubrics": rubrics, "answer": answer}),
            }
        )
    return rows


def _healthbench_row(query: Any) -> dict[str, Any]:
    """The same held-out question as a HealthBench-format benchmark row (graded through eval.grader)."""
    rubrics = [
        {
            "criterion": r["description"],
            "points": -r["weight"] if r["polarity"] == "negative" else r["weight"],
            "tags": [],
        }
        for r in query.rubrics
    ]
    return {"prompt_id": query.query_id, "prompt": [{"role": "user", "content": query.question}], "rubrics": rubrics}


def _researchqa_record(query: Any) -> dict[str, Any]:
    """The held-out question as a ResearchQA record (realliyifei/ResearchQA test.json): unweighted rubric items."""
    return {
        "id": query.query_id,
        "general_domain": "Synthetic",
        "subdomain": "World",
        "field": "Organizations",
        "query": query.question,
        "date": "2025-01",
        "rubric": [{"rubric_item": r["description"], "type": "explanation"} for r in query.rubrics],
    }


def _researchrubrics_row(query: Any) -> dict[str, Any]:
    """The held-out question as a ResearchRubrics row (ScaleAI/researchrubrics processed_data.jsonl)."""
    rubrics = [
        {
            "criterion": r["description"],
            "weight": -r["weight"] if r["polarity"] == "negative" else r["weight"],
            "axis": "Explicit Criteria",
        }
        for r in query.rubrics
    ]
    labels = {"domain": "Synthetic", "conceptual_breadth": "Simple", "logical_nesting": "Shallow", "exploration": "Low"}
    return {"prompt": query.question, "sample_id": query.query_id, **labels, "rubrics": rubrics}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class WorldSearch:
    """Serper's organic results for a query: BM25 over the world's corpus, each document a page."""

    def __init__(self, corpus: Any):
        from rubricem_core.tools.local import LocalSearchTool

        self.docs = {d: (t, x) for d, t, x in zip(*(corpus[c].to_pylist() for c in ("doc_id", "title", "text")))}
        self.bm25 = LocalSearchTool(corpus, top_k=8, snippet_chars=400)

    def __call__(self, query: str, n: int) -> list[dict[str, str]]:
        hits = self.bm25(query).snippet_ids[:n]
        return [{"title": self.docs[d][0], "slug": d, "snippet": self.docs[d][1]} for d in hits]

    def pages(self) -> dict[str, tuple[str, str]]:
        return {
            d: ("text/html; charset=utf-8", f"<html><head><title>{t}</title></head><body><p>{x}</p></body></html>")
            for d, (t, x) in self.docs.items()
        }


def _web_specs(web: FakeWebSearchServer) -> list[dict[str, Any]]:
    """research's own tool specs, pointed at the fake search API (fast retries)."""
    specs = yaml.safe_load((PROFILES_DIR / f"{PROFILE}.yaml").read_text())["tools"]["specs"]
    base = {"serper": web.base_url, "semantic_scholar": f"{web.base_url}/graph/v1"}
    out = []
    for spec in specs:
        spec = {**spec, "backoff_s": 0.0, "timeout_s_http": 10}
        if spec["kind"] in base:
            spec.update(base_url=base[spec["kind"]], api_key_env=_env("SERPER" if spec["kind"] == "serper" else "S2"))
        if spec["kind"] == "web_browse":
            spec["allow_networks"] = ["127.0.0.0/8"]  # the fake pages are on loopback, which browse refuses
        out.append(spec)
    return out


def cpu_overrides(
    tmp: Path,
    servers: dict[str, Any],
    web: FakeWebSearchServer,
    train: str,
    heldout: str,
    benchmark_files: dict[str, str],
    sft_only: str,
) -> dict[str, Any]:
    """What a CPU cannot run swapped out; everything else stays as research.yaml sets it."""
    endpoints = {"teacher": "teacher", "judge": "judge", "reflection.judge": "reflect", "eval.grader": "grader"}
    out: dict[str, Any] = {}
    for section, name in endpoints.items():
        out |= {
            f"{section}.model": f"openai/{name}-model",
            f"{section}.api_base": servers[name].base_url,
            f"{section}.api_key_env": _env(name.upper()),
        }
    return {
        **out,
        "data.queries": [
            {"path": train, "format": "dr_tulu", "split": "train"},
            {"path": sft_only, "format": "dr_tulu", "split": "sft"},
            {"path": heldout, "format": "dr_tulu", "split": "eval"},
        ],
        # research's sft_split is `sft` (SFT data apart from the RL queries); a world of 6 train queries is
        # too small to spare, so the teacher also writes traces for the RL queries here
        "data.sft_split": "sft+train",
        "tools.specs": _web_specs(web),
        "tools.cache_dir": str(tmp / "cache" / "tools"),
        "teacher.batch_poll_interval_s": 0.05,
        "teacher.batch_poll_max_interval_s": 0.1,
        "policy.name_or_path": "tiny",
        "policy.dtype": "float32",
        "policy.max_seq_len": 8192,
        "policy.vocab_size": 1024,
        "policy.hidden_size": 64,
        "policy.n_layers": 2,
        "policy.intermediate_size": 128,
        "distributed.nproc_per_node": 1,
        "distributed.train_devices": None,
        "sft.backend": "torch",
        "sft.precision": "fp32",
        "sft.gradient_checkpointing": False,
        "sft.max_steps": 2,
        "sft.warmup_steps": 1,
        "sft.grad_accum_steps": 1,
        "sft.max_tokens_per_batch": 8192,
        "rollout.engine": "hf",  # the profile's fleet of vllm serve replicas needs GPUs
        "rollout.replicas": 1,
        "rollout.devices": None,
        "rollout.weight_transfer": "checkpoint",
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 2048,
        "rollout.max_total_tokens": 2048,  # equal, as research keeps them
        "rl.backend": "torch",
        "rl.precision": "fp32",
        "rl.gradient_checkpointing": False,
        "rl.reference": "replicated",
        "rl.window": 1,
        "rl.n_windows": 1,
        "rl.queries_per_step": 2,
        "rl.max_tokens_per_batch": 8192,
        "reflection.n_candidates": 3,
        "reflection.embedder": "hashing:64",
        # the run's held-out split (graded in-process) and a HealthBench file (graded through eval.grader)
        "eval.benchmarks": ["synthetic", "healthbench"],
        "eval.paths": benchmark_files,
        "eval.max_queries": 2,
        # a grader per benchmark: ResearchRubrics through its own endpoint, the others through eval.grader
        "eval.graders": {
            "researchrubrics": {
                "model": "openai/grader2-model",
                "api_base": servers["grader2"].base_url,
                "api_key_env": _env("GRADER2"),
            }
        },
    }


@pytest.fixture(scope="module")
def research_run(tmp_path_factory, prefect_harness):
    """One run of the research profile through collection → SFT → two RL steps → evaluation × retrieval."""
    import rubricem_core.rollout.factory as engine_factory
    import tasks.collect as collect_tasks
    import tasks.evaluate as eval_tasks
    import tasks.inputs as input_tasks
    from flows.collect_sft_data import collect_sft_data
    from flows.evaluate import evaluate
    from flows.rl import rl
    from flows.sft import sft
    from rubricem_core.store import RunStore

    tmp = tmp_path_factory.mktemp("research")
    world = generate_world(WORLD)
    marker = f"answer-key-{secrets.token_hex(6)}"
    train_rows = [_dr_tulu_row(q, marker) for q in world.queries if q.split == "train"]
    train = _write_jsonl(tmp / "train.jsonl", train_rows)
    sft_only = _write_jsonl(tmp / "sft.jsonl", _overview_rows(world, marker))  # split sft: SFT data, never RL
    heldout_queries = [q for q in world.queries if q.split == "eval"]
    heldout = _write_jsonl(tmp / "heldout.jsonl", [_dr_tulu_row(q, marker) for q in heldout_queries])
    healthbench = _write_jsonl(tmp / "healthbench.jsonl", [_healthbench_row(q) for q in heldout_queries])
    researchqa = tmp / "researchqa_test.json"
    researchqa.write_text(json.dumps([_researchqa_record(q) for q in heldout_queries]))
    researchrubrics = _write_jsonl(tmp / "researchrubrics.jsonl", [_researchrubrics_row(q) for q in heldout_queries])
    benchmark_files = {"healthbench": healthbench, "researchqa": str(researchqa), "researchrubrics": researchrubrics}
    search = WorldSearch(world.corpus_table())
    teacher = ScriptedTeacher(TeacherRates(max_tool_calls=10))  # research's tools.max_tool_calls
    run_dir = str(tmp / "run")
    times: dict[str, float] = {}
    # matrices this small gain nothing from OpenMP threads; on a busy 2-core machine two spinning threads
    # made generation ~100x slower (tests/tiny_models.py saw the same for training steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with (
        pytest.MonkeyPatch.context() as mp,
        _serve(teacher.respond, "TEACHER") as tserver,
        _serve(builtin_judge_reply, "JUDGE") as jserver,
        _serve(builtin_reflection_judge_reply, "REFLECT") as rserver,
        _serve(builtin_grader_reply, "GRADER") as gserver,
        _serve(builtin_grader_reply, "GRADER2") as g2server,
        FakeWebSearchServer(
            api_key=KEYS["SERPER"], s2_api_key=KEYS["S2"], results_for=search, pages=search.pages()
        ) as web,
    ):
        for name, key in KEYS.items():
            mp.setenv(_env(name), key)
        servers = {"teacher": tserver, "judge": jserver, "reflect": rserver, "grader": gserver, "grader2": g2server}
        overrides = cpu_overrides(tmp, servers, web, train, heldout, benchmark_files, sft_only)
        # even reflection candidates spell a valid reflection (the tiny policy writes none of its own)
        questions: dict[str, str] = {}
        mp.setattr(engine_factory, "HFRolloutEngine", forcing_engine(engine_factory.HFRolloutEngine, questions))
        # every teacher round with freshly built tools, as a round resumed in a new process has them: a browse
        # in round r+1 of an id searched in round r must still open its page
        real_env = collect_tasks.search_env

        def fresh_env(*args: Any) -> Any:
            input_tasks._ENV_CACHE.clear()
            return real_env(*args)

        mp.setattr(collect_tasks, "search_env", fresh_env)
        eval_tasks.drop_engines()

        def timed(stage: str, flow: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            result = flow(run_dir=run_dir, profile=PROFILE, overrides=overrides, **kwargs)
            times[stage] = round(time.monotonic() - start, 1)
            return result

        try:
            collected = timed("collect", collect_sft_data)
            questions.update({q["query_id"]: q["question"] for q in RunStore(run_dir).read_rows("queries")})
            timed("sft", sft)
            timed("rl", rl)
            evaluated = {mode: timed(f"eval-{mode}", evaluate, retrieval=mode) for mode in RETRIEVAL_MODES}
            grader_calls = len(gserver.chat_calls)
            # `rubricem evaluate --benchmark researchqa --benchmark researchrubrics` on the same run
            research_benchmarks = timed(
                "eval-research-benchmarks", evaluate, benchmarks=list(RESEARCH_BENCHMARKS), retrieval="none"
            )
        finally:
            eval_tasks.drop_engines()
            torch.set_num_threads(threads)
    print("stage times (s):", times)
    yield {
        "run_dir": run_dir,
        "store": RunStore(run_dir),
        "collected": collected,
        "evaluated": evaluated,
        "marker": marker,
        "teacher": tserver,
        "judge": jserver,
        "reflect": rserver,
        "grader": gserver,
        "grader2": g2server,
        "grader_calls_before_research_benchmarks": grader_calls,
        "research_benchmarks": research_benchmarks,
        "benchmark_files": benchmark_files,
        "web": web,
        "cache_dir": Path(overrides["tools.cache_dir"]),
        "healthbench": healthbench,
    }


def test_collection_uses_the_batch_api_and_the_web_tools(research_run):
    store, teacher, web = research_run["store"], research_run["teacher"], research_run["web"]
    rows = store.read_rows("sft_trajectories")
    accepted = [r for r in rows if r["accepted"]]
    assert accepted, {r["trajectory_id"]: r["reject_reasons"] for r in rows}
    assert research_run["collected"]["accepted"] == len(accepted)
    assert yaml.safe_load((Path(research_run["run_dir"]) / "config.yaml").read_text())["profile"] == PROFILE
    assert all(r["n_tool_calls"] >= 2 for r in accepted)  # research's filter.min_tool_calls
    # the teacher on the Batch API only: one batch per round, then one for its reflections
    assert teacher.uploaded_lines and len(teacher.batches) >= 3 and not teacher.chat_calls
    assert all(b["status"] == "completed" for b in teacher.batches)
    assert [r for r in store.read_rows("teacher_reflections") if r["valid"]]
    assert research_run["marker"] not in json.dumps(teacher.uploaded_lines)  # the teacher sees the chat only
    # Serper with its key, results cited by their W ids; browse opened pages a search of an earlier round
    # (another process's tools: see fresh_env) returned
    searches = [r for r in web.requests if r[1] == "/search"]
    assert searches and all(r[2].get("x-api-key") == KEYS["SERPER"] for r in searches)
    assert any('<cite id="W' in r["text"] for r in accepted)
    overview = [r for r in accepted if r["query_id"].startswith("dr_tulu-overview")]
    assert overview and all(
        '<call_tool name="browse">W' in r["text"] and "unknown page id" not in r["text"] for r in overview
    )
    assert any(r[1].startswith("/page/") for r in web.requests)
    assert len(ToolCache(research_run["cache_dir"])) > 0  # tools.cache_dir holds the search and browse results


def test_rl_runs_two_steps_with_the_reflection_loop(research_run):
    store = research_run["store"]
    for table in ("rollouts", "judge_scores", "stage_rewards"):
        assert store.partitions(table, "step") == [0, 1], table
    assert store.read_rows("reflections") and store.read_rows("bank")
    # judge.show_reference: false — the queries have an answer key, the judge never saw it
    marker = research_run["marker"]
    assert any(marker in (q["reference_answer"] or "") for q in store.read_rows("queries"))
    prompts = json.dumps(research_run["judge"].chat_calls)
    assert research_run["judge"].chat_calls and marker not in prompts and "REFERENCE ANSWER" not in prompts
    assert marker not in json.dumps(research_run["reflect"].chat_calls)
    # reflection.judge.mode: per_candidate — one call per candidate, each call one candidate; the paper's
    # reward (reflection.invalid_candidates: judged) judges the invalid ones too
    candidates = store.read_rows("reflections")
    calls = research_run["reflect"].chat_calls
    assert [r for r in candidates if r["valid"]] and len(calls) == len(candidates)
    assert not any(r["judge_failed"] for r in candidates)
    assert all(json.dumps(c["messages"]).count("<<<CANDIDATE ") == 1 for c in calls)
    # reflection.warm_bank: the valid teacher reflections seed the bank (step -1), so step 0's cross retrieval
    # finds them; within_source: window — the replay (step 1) retrieves what step 0 wrote for each query
    bank = store.read_rows("bank")
    assert {r["step"] for r in bank} == {-1, 0}
    step0 = {r["query_id"] for r in store.read_rows("rollouts", {"step": 0})}
    assert step0 == {r["query_id"] for r in bank if r["step"] == 0}
    assert all(r["guidance"] for r in store.read_rows("rollouts"))
    # data.sft_split / rl_filter: the sft-only overview questions were SFT data, never an RL query
    assert not any(r["query_id"].startswith("dr_tulu-overview") for r in store.read_rows("rollouts"))
    assert {r["retrieval"] for r in store.read_rows("rollouts", {"step": 1})} == {"within"}
    hits = json.loads(
        run_sql(
            research_run["run_dir"],
            "SELECT name, value FROM metrics WHERE step = 1 AND name LIKE 'retrieval/within_%'",
            fmt="json",
        )
    )
    assert {m["name"]: m["value"] for m in hits} == {"retrieval/within_hits": 2, "retrieval/within_misses": 0}


def test_evaluation_with_every_retrieval_mode(research_run):
    rows = [r for r in research_run["store"].read_rows("eval_results") if r["benchmark"] not in RESEARCH_BENCHMARKS]
    seen = {(r["benchmark"], r["retrieval"]) for r in rows}
    modes = ("none", "cross", "within", "sequential-1", "sequential-2")
    assert seen == {(b, m) for b in ("synthetic", "healthbench") for m in modes}, sorted(seen)
    assert all(r["guidance"] for r in rows if r["retrieval"] in ("cross", "sequential-1"))  # other queries' reflections
    assert not any(r["guidance"] for r in rows if r["retrieval"] == "within")  # held-out queries: nothing of their own
    assert all(r["checkpoint"] == "rl-step-000001" for r in rows)
    # HealthBench graded through eval.grader, one call per criterion (eval.healthbench_grading: per_criterion)
    criteria = {
        f"healthbench-{r['prompt_id']}": len(r["rubrics"])
        for r in map(json.loads, Path(research_run["healthbench"]).read_text().splitlines())
    }
    graded = [r for r in rows if r["benchmark"] == "healthbench" and not r["grade_failed"]]
    calls = research_run["grader_calls_before_research_benchmarks"]
    assert len(graded) == 10 and calls == sum(criteria[r["query_id"]] for r in graded)
    assert research_run["evaluated"]["none"]["benchmarks"]["healthbench"]["n_samples"] == 2


def test_researchqa_and_researchrubrics_each_with_their_own_grader(research_run):
    """The paper's two other headline benchmarks in their published formats: ResearchQA through eval.grader
    (its items rated in batches of 8), ResearchRubrics through its eval.graders entry (one call per criterion)."""
    from rubricem_core.readers import read_queries

    rows = [r for r in research_run["store"].read_rows("eval_results") if r["benchmark"] in RESEARCH_BENCHMARKS]
    assert {(r["benchmark"], r["retrieval"]) for r in rows} == {(b, "none") for b in RESEARCH_BENCHMARKS}
    assert all(not r["grade_failed"] and 0.0 <= r["score"] <= 1.0 for r in rows)
    assert all(r["checkpoint"] == "rl-step-000001" for r in rows)
    by_benchmark = {b: [r for r in rows if r["benchmark"] == b] for b in RESEARCH_BENCHMARKS}
    assert {r["grader"] for r in by_benchmark["researchqa"]} == {"openai/grader-model"}
    assert {r["grader"] for r in by_benchmark["researchrubrics"]} == {"openai/grader2-model"}
    files = research_run["benchmark_files"]
    items = {q.query_id: len(q.rubrics) for b in RESEARCH_BENCHMARKS for q in read_queries(files[b], format=b)}
    rubric_calls = sum(items[r["query_id"]] for r in by_benchmark["researchrubrics"])
    assert len(research_run["grader2"].chat_calls) == rubric_calls > 0
    coverage_calls = sum(-(-items[r["query_id"]] // 8) for r in by_benchmark["researchqa"])
    grader = research_run["grader"]
    assert len(grader.chat_calls) - research_run["grader_calls_before_research_benchmarks"] == coverage_calls
    assert all("(rubric_coverage)" in json.dumps(b) for b in grader.chat_calls[-coverage_calls:])
    summary = research_run["research_benchmarks"]["benchmarks"]
    assert {b: summary[b]["n_samples"] for b in RESEARCH_BENCHMARKS} == {b: 2 for b in RESEARCH_BENCHMARKS}
