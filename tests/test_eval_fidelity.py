"""Paper-fidelity modes of evaluation (issue #20): a seeded random sample of each benchmark,
HealthBench graded one criterion per call, DeepResearchBench graded by RACE against reference
reports, and test-time sequential reuse (trial 1 cross → reflection → trial 2 guided by it)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from rubricem_core.eval import run as eval_run
from rubricem_core.eval.grading import NO_REFERENCE, ungraded_reason
from rubricem_core.eval.llm_grader import BenchmarkGrader, GraderOptions
from rubricem_core.eval.prompts import aggregate_race, grade_items, race_messages
from rubricem_core.eval.queries import load_benchmark_queries, select_queries
from rubricem_core.eval.run import EvalOptions, SequentialOptions, reflection_guidance, run_eval
from rubricem_core.eval.types import EvalError, EvalSample
from rubricem_core.llm.types import EndpointSettings
from rubricem_core.readers import DRB_REFERENCE_KEY, attach_drb_references, read_drb_references
from rubricem_core.reflection.format import guidance_text, parse_reflection
from rubricem_core.rollout.types import ANSWERED
from rubricem_core.schemas import Query
from rubricem_core.sim.grader import register_builtin_grader
from rubricem_core.testing.openai_server import FakeOpenAIServer
from tests.benchmark_rubrics import eval_query, rubric
from tests.conftest import shared_file
from tests.llm_endpoints import API_KEY, make_settings

DRB_DIR = "deep_research_bench"
DRB_QUERIES = f"{DRB_DIR}/prompt_data_query.jsonl"
DRB_REFERENCES = f"{DRB_DIR}/test_data_cleaned_data_claude-3-7-sonnet-latest.jsonl"


def query(query_id: str, source: str = "scholarqa_cs", rubrics: list | None = None, **kw: Any) -> Query:
    return eval_query(query_id, source, f"Question {query_id}?", rubrics or [], **kw)


def settings(server: FakeOpenAIServer) -> EndpointSettings:
    return make_settings(server, model="openai/grader-model", max_retries=0)


def _user(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


# ---- 1. which queries: the first N or a seeded random sample ---------------------------------------


POOL = [query(f"q{i:03d}") for i in range(50)]


def ids(queries: list[Query]) -> list[str]:
    return [q.query_id for q in queries]


def test_first_is_the_head_of_the_file():
    assert ids(select_queries(POOL, 5)) == ids(POOL[:5])
    assert ids(select_queries(POOL, 5, "first", seed=123)) == ids(POOL[:5])  # the seed does not matter


def test_random_sample_is_stable_per_seed_and_differs_across_seeds():
    same = [ids(select_queries(POOL, 8, "random", seed=7)) for _ in range(2)]
    assert same[0] == same[1] and len(set(same[0])) == 8
    assert same[0] != ids(POOL[:8])
    assert set(ids(select_queries(POOL, 8, "random", seed=8))) != set(same[0])


def test_random_sample_ignores_file_order_and_grows_as_a_superset():
    shuffled = POOL[:]
    random.Random(0).shuffle(shuffled)
    chosen = select_queries(POOL, 8, "random", seed=3)
    assert set(ids(select_queries(shuffled, 8, "random", seed=3))) == set(ids(chosen))
    assert ids(chosen) == sorted(ids(chosen))  # kept in file order
    assert set(ids(chosen)) <= set(ids(select_queries(POOL, 20, "random", seed=3)))
    assert ids(select_queries(POOL, 80, "random", seed=3)) == ids(POOL)  # fewer than asked: all of them


def test_all_is_the_full_set_in_file_order_whatever_the_sample():
    from rubricem_core.config import ConfigError, load_config

    assert ids(select_queries(POOL, "all")) == ids(select_queries(POOL, "all", "random", seed=3)) == ids(POOL)
    assert load_config("tiny", {"eval.max_queries": "all"}).eval.max_queries == "all"
    with pytest.raises(ConfigError, match="max_queries must be at least 1 or 'all'"):
        load_config("tiny", {"eval.max_queries": 0})
    with pytest.raises(ConfigError, match="max_queries"):
        load_config("tiny", {"eval.max_queries": "most"})


def test_unknown_sample_mode_is_refused():
    with pytest.raises(EvalError, match="eval.sample"):
        select_queries(POOL, 3, "stratified")


def test_random_sample_of_a_real_benchmark_file(shared_data):
    path = shared_file(shared_data, "simpleqa/simple_qa_test_set.csv")
    first = load_benchmark_queries("simpleqa", path, 5)
    a = load_benchmark_queries("simpleqa", path, 5, "random", 0)
    b = load_benchmark_queries("simpleqa", path, 5, "random", 0)
    c = load_benchmark_queries("simpleqa", path, 5, "random", 1)
    assert ids(first) == [f"simpleqa-{i:05d}" for i in range(5)]
    assert ids(a) == ids(b) and ids(a) != ids(c) and ids(a) != ids(first)


def test_the_sample_is_part_of_the_eval_settings():
    from rubricem_core.config import load_config
    from rubricem_core.eval.benchmark import grading_settings, sample_seed
    from rubricem_core.eval.run import settings_digest

    first = load_config("tiny")
    assert grading_settings(first, "scholarqa_cs", []) == {}  # legacy settings: existing digests stay
    # a protocol that changed (issue #46: each short-answer benchmark by its own grader) re-grades old parts
    assert grading_settings(first, "simpleqa", []) == {"protocol": "short_form"}
    assert grading_settings(first, "2wiki", []) == {"protocol": "short_form_equivalence"}
    assert grading_settings(first, "researchrubrics", []) == {"grading": "verdict/binary"}
    rand = load_config("tiny", {"eval.sample": "random"})
    other = load_config("tiny", {"eval.sample": "random", "eval.sample_seed": 5})
    assert sample_seed(rand) == rand.seed and sample_seed(other) == 5
    digests = {settings_digest(grading_settings(c, "simpleqa", [])) for c in (first, rand, other)}
    assert len(digests) == 3
    assert load_config("gpu").eval.sample == "random"


# ---- 2. HealthBench: one grader call per criterion -------------------------------------------------


HEALTH = query(
    "h1",
    "healthbench",
    rubrics=[
        rubric("Advises calling emergency services", 5, points=5),
        rubric("Asks about the duration of the pain", 3, points=3),
        rubric("Recommends an unproven supplement", 2, "negative", points=-2),
    ],
)


def _criterion_id(body: dict[str, Any]) -> str:
    """The item's id from the prompt's rubric item, shown as simple-evals does: ``[points] criterion``."""
    line = _user(body).split("<<<RUBRIC ITEM>>>\n", 1)[1].split("\n", 1)[0]
    points, text = re.match(r"^\[(-?[\d.]+)\] (.*)$", line).groups()
    index = [r["description"] for r in HEALTH.rubrics].index(text)
    assert float(points) == HEALTH.rubrics[index]["check"]["points"]
    return f"i{index + 1}"


def met_first_and_third(body: dict[str, Any]) -> str:
    assert "(rubric_criterion)" in _user(body).split("\n", 1)[0]
    met = _criterion_id(body) in ("i1", "i3")
    return json.dumps({"explanation": "points at the response", "criteria_met": met})


def test_one_call_per_criterion_and_the_score_worked_by_hand():
    with FakeOpenAIServer(met_first_and_third, api_key=API_KEY) as server:
        grader = BenchmarkGrader(settings(server), GraderOptions(healthbench_grading="per_criterion"))
        first, second = grader.grade("healthbench", [(HEALTH, "answer one"), (HEALTH, "answer two")])
        assert len(server.chat_calls) == 2 * 3  # answers × criteria
        assert sorted(_criterion_id(b) for b in server.chat_calls) == ["i1", "i1", "i2", "i2", "i3", "i3"]
        assert all(b["response_format"]["json_schema"]["name"] == "criterion_grade" for b in server.chat_calls)
        # simple-evals' layout: the conversation ends with the graded response as the assistant's turn
        conversations = [_user(b).split("<<<CONVERSATION>>>\n", 1)[1].split("\n\n<<<", 1)[0] for b in server.chat_calls]
        assert {c for c in conversations} == {
            "user: Question h1?\n\nassistant: answer one",
            "user: Question h1?\n\nassistant: answer two",
        }
    # points 5, 3, -2; met: the first and the third → (5 - 2) / (5 + 3)
    assert first.score == pytest.approx((5 - 2) / 8) and second.score == pytest.approx(3 / 8)
    assert [i["score"] for i in first.details["items"]] == [1, 0, 1]
    assert first.details["achieved_points"] == 3 and first.details["positive_points"] == 8
    assert grader.usage.calls["score"] == 6


def test_the_sum_is_clipped_at_zero():
    def only_the_harm(body: dict[str, Any]) -> str:
        return json.dumps({"explanation": "x", "criteria_met": _criterion_id(body) == "i3"})

    with FakeOpenAIServer(only_the_harm, api_key=API_KEY) as server:
        [result] = BenchmarkGrader(settings(server)).grade("healthbench", [(HEALTH, "take this supplement")])
    assert result.score == 0.0 and result.details["raw"] == pytest.approx(-2 / 8)


def test_a_failed_criterion_call_fails_the_grade_not_scores_it():
    def broken_second(body: dict[str, Any]) -> str:
        if _criterion_id(body) == "i2":
            return '{"criteria_met": "perhaps"}'
        return met_first_and_third(body)

    with FakeOpenAIServer(broken_second, api_key=API_KEY) as server:
        grader = BenchmarkGrader(settings(server))
        [result] = grader.grade("healthbench", [(HEALTH, "text")])
    assert result.failed and result.score is None
    assert result.error.startswith("1 of 3 criterion calls failed: i2: ")
    assert [("score" in i, "error" in i) for i in result.details["items"]] == [
        (True, False),
        (False, True),
        (True, False),
    ]
    assert grader.usage.failures["score"] == 1 and grader.usage.repairs["score"] == 1


def test_builtin_grader_gives_the_same_scores_per_criterion_and_joint(shared_data):
    path = shared_file(shared_data, "healthbench/healthbench_oss_eval_sample30.jsonl")
    queries = load_benchmark_queries("healthbench", path, 4)
    pairs = [(q, " ".join(r["description"] for r in q.rubrics[:3])) for q in queries] + [(queries[0], "Rest.")]
    builtin = EndpointSettings(model=register_builtin_grader(), max_concurrency=4, max_retries=0)
    per = BenchmarkGrader(builtin, GraderOptions(healthbench_grading="per_criterion"))
    joint = BenchmarkGrader(builtin, GraderOptions(healthbench_grading="joint"))
    per_scores, joint_scores = ([r.score for r in g.grade("healthbench", pairs)] for g in (per, joint))
    assert per_scores == pytest.approx(joint_scores) and not any(s is None for s in per_scores)
    assert per.usage.calls["score"] == sum(len(q.rubrics) for q, _ in pairs) and joint.usage.calls["score"] == 5


def test_unknown_grading_modes_are_refused():
    with pytest.raises(EvalError, match="healthbench_grading"):
        GraderOptions(healthbench_grading="batch")
    with pytest.raises(EvalError, match="drb_grading"):
        GraderOptions(drb_grading="relative")


# ---- 3. DeepResearchBench: RACE against a reference report ---------------------------------------


def _drb(reference: str | None = "The reference report.") -> Query:
    metadata = {DRB_REFERENCE_KEY: reference} if reference else {}
    return query(
        "d1",
        "deep_research_bench",
        metadata=metadata,
        rubrics=[
            rubric(
                "Explains the market size",
                0.6,
                dimension="comprehensiveness",
                dimension_weight=0.4,
                criterion_weight=0.6,
                criterion="Market size",
            ),
            rubric(
                "Names competitors",
                0.4,
                dimension="comprehensiveness",
                dimension_weight=0.4,
                criterion_weight=0.4,
                criterion="Competitors",
            ),
            rubric("Clear structure", 1.0, dimension="readability", dimension_weight=0.6, criterion_weight=1.0),
        ],
    )


DRB_Q = _drb()
# (target, reference) per criterion: comprehensiveness t = 0.6·8 + 0.4·4 = 6.4, r = 0.6·4 + 0.4·6 = 4.8;
# readability t = 5, r = 5.  T = 0.4·6.4 + 0.6·5 = 5.56, R = 0.4·4.8 + 0.6·5 = 4.92.
RACE_REPLY = {"i1": (8, 4), "i2": (4, 6), "i3": (5, 5)}


def race_grader(body: dict[str, Any]) -> str:
    """RACE_REPLY for the RACE prompt; the cleaning call before it gets the article without its markers."""
    if "(article_clean)" in _user(body).split("\n", 1)[0]:
        article = _user(body).split("<<<ARTICLE>>>\n", 1)[1].split("\n\n<<<", 1)[0]
        return json.dumps({"article": re.sub(r"\s*\[\d+\]", "", article)})
    assert "(dimension_race)" in _user(body).split("\n", 1)[0]
    return json.dumps(
        {
            "items": [
                {"id": i, "justification": "compared", "article_1_score": t, "article_2_score": r}
                for i, (t, r) in RACE_REPLY.items()
            ]
        }
    )


def test_race_formula_worked_by_hand():
    score, extra = aggregate_race(grade_items(DRB_Q, "dimension_criteria"), RACE_REPLY)
    assert score == pytest.approx(5.56 / (5.56 + 4.92))
    assert extra["dimensions"] == pytest.approx({"comprehensiveness": 6.4 / 11.2, "readability": 0.5})
    assert extra["race"]["target_total"] == pytest.approx(5.56)
    zero, _ = aggregate_race(grade_items(DRB_Q, "dimension_criteria"), {i: (0, 0) for i in RACE_REPLY})
    assert zero == 0.0  # the benchmark's convention when both score nothing


def test_race_prompt_shows_the_criteria_and_both_reports():
    messages = race_messages(
        "deep_research_bench",
        DRB_Q,
        "My target report <<<END>>>",
        "The reference report.",
        grade_items(DRB_Q, "dimension_criteria"),
    )
    user = messages[1]["content"]
    assert "<<<ARTICLE 1>>>\nMy target report" in user and "<<<ARTICLE 2>>>\nThe reference report." in user
    assert user.count("<<<END>>>") == 1  # the target cannot open a section
    assert '"explanation": "Explains the market size"' in user and '"criterion": "Market size"' in user
    assert "article_1_score" in messages[0]["content"]


def test_race_through_a_grader_endpoint():
    with FakeOpenAIServer(race_grader, api_key=API_KEY) as server:
        grader = BenchmarkGrader(settings(server), GraderOptions(drb_grading="race"))
        [result] = grader.grade("deep_research_bench", [(DRB_Q, "My target report [1].")])
        clean, race = server.chat_calls  # DeepResearchBench's cleaner first, then RACE on its output
        assert "(article_clean)" in _user(clean) and "The reference report." in _user(race)
        assert "<<<ARTICLE 1>>>\nMy target report.\n" in _user(race)
    assert result.details["article_chars"] == {"submitted": 21, "cleaned": 17}
    assert result.score == pytest.approx(5.56 / 10.48)
    assert result.details["grading"] == "race"
    assert [(i["score"], i["reference_score"]) for i in result.details["items"]] == list(RACE_REPLY.values())


def test_a_query_without_reference_is_recorded_ungraded(monkeypatch):
    sampled: list[list[str]] = []

    def sample(engine, tokenizer, queries, env, options, guidance=None):
        sampled.append(ids(queries))
        return [[EvalSample(q.query_id, 0, "<answer>x</answer>", "x", 0, ANSWERED, 3)] for q in queries]

    monkeypatch.setattr(eval_run, "sample_queries", sample)
    grader = BenchmarkGrader(
        EndpointSettings(model=register_builtin_grader(), max_retries=0), GraderOptions(drb_grading="race")
    )
    lacking = _drb(None)
    lacking.query_id = "d2"
    outcome = run_eval(None, None, "deep_research_bench", [DRB_Q, lacking], None, EvalOptions(), "ck", grader)
    assert sampled == [["d1"]]
    [row] = [r for r in outcome.rows if r["query_id"] == "d2"]
    assert row["score"] is None and row["error"].startswith(f"{NO_REFERENCE}: ")
    assert "eval.paths.deep_research_bench_reference" in row["error"]
    assert outcome.summary["n_no_reference"] == 1 and outcome.summary["n_ungraded"] == 1
    assert ungraded_reason("deep_research_bench", lacking) is None  # absolute grading needs none
    with pytest.raises(EvalError, match=r"1 no_reference"):
        run_eval(None, None, "deep_research_bench", [lacking], None, EvalOptions(), "ck", grader)


def test_race_without_the_reference_path_names_the_config_field():
    from rubricem_core.config import load_config
    from rubricem_core.eval.benchmark import eval_queries
    from rubricem_core.store import RunStore

    cfg = load_config("tiny", {"eval.drb_grading": "race"})
    cfg.eval.paths.pop("deep_research_bench_reference", None)
    with pytest.raises(EvalError, match=r"eval.paths.deep_research_bench_reference"):
        eval_queries(RunStore("unused"), cfg, "deep_research_bench")


def test_the_reader_finds_references_in_the_shared_data(shared_data):
    references = read_drb_references(shared_file(shared_data, DRB_REFERENCES))
    assert len(references) == 100 and all(text.strip() for text in references.values())
    queries = load_benchmark_queries(
        "deep_research_bench",
        shared_file(shared_data, DRB_QUERIES),
        100,
        "random",
        0,
        shared_file(shared_data, DRB_REFERENCES),
    )
    assert len(queries) == 100 and all(q.metadata[DRB_REFERENCE_KEY] == references[q.query_id] for q in queries)


def test_a_reference_for_another_prompt_is_refused(tmp_path):
    path = tmp_path / "reference.jsonl"
    path.write_text(json.dumps({"id": "d1", "prompt": "Another task", "article": "text"}) + "\n", encoding="utf-8")
    renamed = query("deep_research_bench-d1", "deep_research_bench")
    with pytest.raises(ValueError, match="another prompt"):
        attach_drb_references([renamed], path)


def test_builtin_grader_answers_the_race_prompt(shared_data):
    queries = [
        q
        for q in load_benchmark_queries(
            "deep_research_bench",
            shared_file(shared_data, DRB_QUERIES),
            100,
            reference_path=shared_file(shared_data, DRB_REFERENCES),
        )
        if q.metadata.get("language") == "en"
    ][:2]
    grader = BenchmarkGrader(
        EndpointSettings(model=register_builtin_grader(), max_concurrency=2, max_retries=0),
        GraderOptions(drb_grading="race"),
    )
    same, nothing = (
        grader.grade("deep_research_bench", [(q, text(q)) for q in queries])
        for text in (lambda q: q.metadata[DRB_REFERENCE_KEY], lambda q: "The weather is nice today.")
    )
    assert [r.score for r in same] == pytest.approx([0.5, 0.5])  # the reference against itself
    assert all(r.score < 0.5 for r in nothing), [r.score for r in nothing]
    assert set(same[0].details["dimensions"]) == {
        "comprehensiveness",
        "insight",
        "instruction_following",
        "readability",
    }


# ---- 4. test-time sequential reuse -----------------------------------------------------------------


REFLECTION = (
    "<reflection>\n<reflection_rubrics>\n- Names the retrieval method\n</reflection_rubrics>\n<takeaways>\n"
    "- Search for benchmarks before answering\n</takeaways>\n</reflection>"
)
PROPERTIES = [rubric("Mentions retrieval-augmented generation", 2), rubric("Discusses evaluation benchmarks", 1)]


class NoHitBank:
    """A bank with nothing similar: cross retrieval finds no reflection."""

    def __init__(self) -> None:
        self.modes: list[str] = []

    def retrieve_many(self, queries, mode, k=1, min_similarity=None):
        self.modes.append(mode)
        return [[] for _ in queries]


def sequential_eval(engine: Any, tokenizer: Any, queries: list[Query], *bank_and_options: Any, samples: int = 1) -> Any:
    """run_eval of scholarqa_cs queries with sequential retrieval, graded by the built-in grader (no retries);
    ``bank_and_options``: run_eval's reflection bank and SequentialOptions."""
    grader = BenchmarkGrader(EndpointSettings(model=register_builtin_grader(), max_retries=0))
    options = EvalOptions(samples_per_query=samples, retrieval="sequential")
    return run_eval(engine, tokenizer, "scholarqa_cs", queries, None, options, "ck", grader, *bank_and_options)


def test_sequential_runs_two_trials_guided_by_the_first_trials_reflection(monkeypatch):
    calls: dict[str, Any] = {}

    def trial_one(engine, tokenizer, queries, env, options, guidance=None):
        calls["first"] = dict(guidance or {})
        return [
            [
                EvalSample(q.query_id, i, "<answer>RAG.</answer>", "RAG.", 0, ANSWERED, 4)
                for i in range(options.samples_per_query)
            ]
            for q in queries
        ]

    def reflect(engine, tokenizer, queries, samples, env, options, sequential):
        calls["reflect"] = [(s.query_id, s.sample) for group in samples for s in group]
        return [
            {
                "query_id": s.query_id,
                "sample": s.sample,
                "text": REFLECTION if s.sample == 0 else "no tags",
                "valid": s.sample == 0,
                "codes": [],
            }
            for group in samples
            for s in group
        ]

    def trial_two(engine, tokenizer, queries, env, options, guidance, tag="t2"):
        calls["second"] = dict(guidance)
        answer = "Retrieval-augmented generation, with evaluation benchmarks."
        return [
            [
                EvalSample(
                    q.query_id, i, f"<answer>{answer}</answer>", answer, 1, ANSWERED, 9, guidance.get((q.query_id, i))
                )
                for i in range(options.samples_per_query)
            ]
            for q in queries
        ]

    monkeypatch.setattr(eval_run, "sample_queries", trial_one)
    monkeypatch.setattr(eval_run, "reflect_on_trials", reflect)
    monkeypatch.setattr(eval_run, "sample_guided", trial_two)
    bank = NoHitBank()
    queries = [query("a", rubrics=PROPERTIES), query("b", rubrics=PROPERTIES), query("c")]  # c: no rubrics
    outcome = sequential_eval(None, None, queries, bank, SequentialOptions(), samples=2)
    assert bank.modes == ["cross"] and calls["first"] == {"a": None, "b": None}
    assert calls["reflect"] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    within = guidance_text(parse_reflection(REFLECTION))  # as within retrieval shows a query's own reflection
    assert calls["second"] == {("a", 0): within, ("b", 0): within}  # sample 1's reflection was invalid

    rows = outcome.rows
    assert [r["retrieval"] for r in rows] == ["sequential-1"] * 5 + ["sequential-2"] * 5  # 2 + 2 + c's ungraded row
    second = [r for r in rows if r["retrieval"] == "sequential-2" and r["score"] is not None]
    first = [r for r in rows if r["retrieval"] == "sequential-1" and r["score"] is not None]
    assert [r["guidance"] for r in second] == [within, None, within, None]
    s = outcome.summary
    assert s["score_mean"] == pytest.approx(sum(r["score"] for r in second) / 4)
    assert s["trial1/score_mean"] == pytest.approx(sum(r["score"] for r in first) / 4)
    assert s["score_mean"] > s["trial1/score_mean"]
    assert s["n_ungraded"] == 1 and s["trial1/n_ungraded"] == 1
    assert s["sequential/reflection_valid_rate"] == 0.5 and s["sequential/guided_rate"] == 0.5


def test_sequential_needs_a_bank_for_its_first_trial(monkeypatch):
    monkeypatch.setattr(eval_run, "sample_queries", lambda *a, **k: pytest.fail("sampled without a bank"))
    with pytest.raises(EvalError, match="needs a reflection bank"):
        sequential_eval(None, None, [query("a", rubrics=PROPERTIES)])


def test_reflection_guidance_keeps_valid_reflections_with_items():
    rows = [
        {"query_id": "a", "sample": 0, "text": REFLECTION, "valid": True},
        {"query_id": "a", "sample": 1, "text": REFLECTION, "valid": False},
        {"query_id": "b", "sample": 0, "text": "<reflection></reflection>", "valid": True},
    ]
    assert set(reflection_guidance(rows)) == {("a", 0)}
    assert set(reflection_guidance(rows, valid_only=False)) == {("a", 0), ("a", 1)}


class CharTokenizer:
    """Characters as token ids: enough for encode_prompt and for the scripted engine to read prompts."""

    chat_template = "scripted"
    eos_token = "<eos>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "\n".join(f"[{m['role']}] {m['content']}" for m in messages) + "\n[assistant] "

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class ScriptedEngine:
    """Reflects with REFLECTION when asked to; answers well only when the prompt carries its guidance."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def generate(self, requests, env):
        from rubricem_core.trajectory import TokenSegment, TokenTrajectory

        self.requests += requests
        out = []
        for request in requests:
            prompt = "".join(map(chr, request.prompt_ids))
            if "<<<ATTEMPT>>>" in prompt:
                text = REFLECTION
            elif "Names the retrieval method" in prompt:
                text = "<answer>Retrieval-augmented generation, with evaluation benchmarks.</answer>"
            else:
                text = "<answer>Not sure.</answer>"
            out.append(
                [
                    TokenTrajectory(
                        [1], [1], [0], [0.0], [TokenSegment("policy", "answer", 0, 1, text)], finish_reason=ANSWERED
                    )
                    for _ in range(request.n)
                ]
            )
        return out


def test_sequential_end_to_end_with_a_scripted_policy():
    engine = ScriptedEngine()
    outcome = sequential_eval(engine, CharTokenizer(), [query("a", rubrics=PROPERTIES)], NoHitBank())
    assert [r.request_id for r in engine.requests] == ["a", "a#0", "a#t2-0"]  # trial 1, reflection, trial 2
    assert engine.requests[1].max_tool_calls == 0
    first, second = outcome.rows
    assert (first["retrieval"], first["guidance"]) == ("sequential-1", None)
    assert second["retrieval"] == "sequential-2" and "Names the retrieval method" in second["guidance"]
    assert second["score"] > first["score"]
    assert outcome.summary["sequential/reflection_valid_rate"] == 1.0
