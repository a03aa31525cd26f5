"""The `eval` section: benchmarks, their grading protocols and graders."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from rubricem_core.config.base import _Strict, check_known
from rubricem_core.config.endpoints import EndpointConfig

EVAL_BENCHMARKS: tuple[str, ...] = (
    "synthetic",
    "healthbench",
    "deep_research_bench",
    "scholarqa_cs",
    "simpleqa",
    "2wiki",
    "researchqa",
    "researchrubrics",
    "webwalkerqa",
    "deepsearchqa",
)
# Benchmarks with a choice of grading protocol (the first is the default); the others have one each.
EVAL_PROTOCOLS: dict[str, tuple[str, ...]] = {
    "healthbench": ("per_criterion", "joint"),
    "deep_research_bench": ("absolute", "race"),
    "researchrubrics": ("binary", "ternary"),
}
# ... and the eval setting (also the GraderOptions field) that holds each one's protocol
EVAL_PROTOCOL_SETTINGS: dict[str, str] = {
    "healthbench": "healthbench_grading",
    "deep_research_bench": "drb_grading",
    "researchrubrics": "researchrubrics_grading",
}
EVAL_EXTRA_PATHS: tuple[str, ...] = ("deep_research_bench_reference",)  # eval.paths keys besides benchmarks


class EvalGraderConfig(EndpointConfig):
    model: str = Field(
        default="rubricem-grader/builtin",
        description="litellm model string of the benchmark grader. 'rubricem-grader/...' is the built-in offline "
        "grader (normalized string match for short answers, lexical/checkable evidence for rubric items).",
    )
    temperature: float = Field(default=0.0, ge=0, le=2, description="Grader sampling temperature.")
    max_tokens: int = Field(default=4096, ge=64, description="Completion tokens per grading call.")
    structured_output: Literal["json_schema", "json_object", "none"] = Field(
        default="json_schema", description="How JSON replies are requested from the provider."
    )


class BenchmarkGraderConfig(EvalGraderConfig):
    """The grader of one benchmark (an entry of eval.graders): every field it leaves out is eval.grader's."""

    protocol: str | None = Field(
        default=None,
        description="Grading protocol: healthbench per_criterion|joint, deep_research_bench absolute|race, "
        "researchrubrics binary|ternary (None: eval.healthbench_grading / eval.drb_grading / "
        "eval.researchrubrics_grading). The other benchmarks have one protocol each (leave None).",
    )


class APIPolicyConfig(EndpointConfig):
    """How to reach a model behind an API evaluated as the policy (`--checkpoint api:<model>`)."""

    model: str = Field(
        default="",
        description="Unused: the checkpoint argument names the model (api:<model> with the scaffold's prompt, "
        "api-plain:<model> without it); the other fields say how to reach it.",
    )
    max_tokens: int = Field(
        default=2048, ge=64, le=65_536, description="Completion tokens per turn (between tool calls)."
    )
    max_rounds: int = Field(
        default=12, ge=1, le=200, description="Turns per trajectory at most (each ends at a tool call or the answer)."
    )


class EvalConfig(_Strict):
    benchmarks: list[str] = Field(
        default_factory=lambda: ["synthetic"],
        description=f"Benchmarks to evaluate, any of {', '.join(EVAL_BENCHMARKS)}. 'synthetic' is the run's held-out "
        "split (built-in deterministic grader); the others read `paths` and are graded through `grader`.",
    )
    paths: dict[str, str] = Field(
        default_factory=dict,
        description="Benchmark name → query file (relative paths resolve against the working directory), e.g. "
        "{simpleqa: ../shared/data/simpleqa/simple_qa_test_set.csv}; plus deep_research_bench_reference → the "
        "benchmark's reference reports (JSONL of id, prompt, article), needed by drb_grading: race.",
    )
    max_queries: int | Literal["all"] = Field(
        default=8,
        description="Queries per benchmark (chosen by `sample`), or all: the full set (the paper's Table 1; its "
        "ablations use a fixed seeded 100: max_queries 100, sample random). The chosen ids, in order, are written "
        "to state/eval_queries/<part>.json beside each eval_results part.",
    )
    sample: Literal["first", "random"] = Field(
        default="first",
        description="Which max_queries queries of a benchmark file (or the held-out split) are evaluated: the first "
        "ones, or a fixed random sample drawn with sample_seed (the same seed picks the same queries, whatever the "
        "file order; a larger max_queries picks a superset).",
    )
    sample_seed: int | None = Field(default=None, description="Seed of sample: random (None: the run's seed).")
    healthbench_grading: Literal["per_criterion", "joint"] = Field(
        default="per_criterion",
        description="HealthBench: per_criterion (one met/not-met grader call per rubric criterion, as the official "
        "grader; one failed call fails that answer's grade) or joint (one call grading all criteria). Both give the "
        "same scores with the built-in grader. graders.healthbench.protocol overrides it.",
    )
    drb_grading: Literal["absolute", "race"] = Field(
        default="absolute",
        description="DeepResearchBench: absolute (each criterion scored 0..10 on its own) or race (the benchmark's "
        "RACE: the report and the query's reference report scored on the same criteria, score T / (T + R) of the "
        "dimension-weighted totals; needs paths.deep_research_bench_reference, queries without a reference are "
        "recorded ungraded as no_reference). graders.deep_research_bench.protocol overrides it.",
    )
    researchrubrics_grading: Literal["binary", "ternary"] = Field(
        default="binary",
        description="ResearchRubrics, graded as its release (one verdict call per rubric; reports longer than the "
        "grader's context read in chunks): binary (Satisfied 1 / Not Satisfied 0, the current release) or ternary "
        "(Partially Satisfied 0.5 too, the paper-era pipeline). graders.researchrubrics.protocol overrides it.",
    )
    samples_per_query: int = Field(default=1, ge=1, description="Trajectories sampled per query (scores are averaged).")
    temperature: float = Field(default=0.7, ge=0, description="Sampling temperature of the policy (0 = greedy).")
    retrieval: Literal["none", "cross", "within", "sequential"] = Field(
        default="none",
        description="Test-time reflection guidance from the run's bank: none, cross (top-k other queries), "
        "within (the query's own reflection) or sequential (trial 1 with cross retrieval, the policy reflects "
        "on it, trial 2 guided by that reflection; the paper's test-time reuse).",
    )
    retrieval_k: int = Field(default=1, ge=1, description="Reflections retrieved per query for retrieval=cross.")
    reflection_validity: bool = Field(
        default=True,
        description="Also ask the policy for one reflection on each evaluated trajectory (unforced) and report the "
        "share that passes the meta-policy's validator (reflection_valid_rate; rows in eval_reflections).",
    )
    bank_dir: str | None = Field(
        default=None, description="Saved ReflectionBank directory (None: <run_dir>/state/bank, where RL saves it)."
    )
    bank_embedder: str | None = Field(
        default=None,
        description="Override of the bank's query embedder (see tools.embedder), e.g. the local path of the model "
        "it was built with; None: the embedder recorded with the saved bank. One of another dimension is refused.",
    )
    api_policy: APIPolicyConfig = Field(
        default_factory=APIPolicyConfig,
        description="The endpoint of a model behind an API evaluated as the policy (rubricem evaluate --checkpoint "
        "api:<model> or api-plain:<model>; the built-in teacher, rubricem-teacher/scripted, offline). Its key "
        "variable, base URL, concurrency, turn length and rounds.",
    )
    grader: EvalGraderConfig = Field(
        default_factory=EvalGraderConfig,
        description="Judge endpoint of the benchmark graders (of every benchmark without an eval.graders entry).",
    )
    graders: dict[str, BenchmarkGraderConfig] = Field(
        default_factory=dict,
        description="Benchmark name → its own grader (model, endpoint, protocol), e.g. {deep_research_bench: "
        "{model: gemini/gemini-2.5-pro, api_key_env: GEMINI_API_KEY, protocol: race}}; fields an entry leaves out "
        "are eval.grader's, and a benchmark without an entry is graded through eval.grader.",
    )

    @model_validator(mode="before")
    @classmethod
    def _graders_inherit(cls, data: Any) -> Any:
        # an entry is eval.grader with the entry's own fields on top; resolved here, so a dumped config
        # reads back to the same graders
        if not isinstance(data, dict) or not isinstance(data.get("graders"), dict):
            return data
        base = data.get("grader") or {}
        base = base.model_dump() if isinstance(base, BaseModel) else dict(base)
        graders = {}
        for name, entry in data["graders"].items():
            if isinstance(entry, dict):
                entry = {**base, **entry}
            graders[name] = entry
        return {**data, "graders": graders}

    @field_validator("graders")
    @classmethod
    def _known_graders(cls, value: dict[str, BenchmarkGraderConfig]) -> dict[str, BenchmarkGraderConfig]:
        valid = [b for b in EVAL_BENCHMARKS if b != "synthetic"]
        check_known(value, valid, "graders has unknown benchmarks {unknown}; choose from {known}")
        for name, entry in value.items():
            if entry.protocol is None:
                continue
            choices = EVAL_PROTOCOLS.get(name)
            if choices is None:
                raise ValueError(f"graders.{name}.protocol: {name} has one grading protocol; leave protocol unset")
            if entry.protocol not in choices:
                raise ValueError(f"graders.{name}.protocol must be one of {list(choices)}, got {entry.protocol!r}")
        return value

    def grader_for(self, benchmark: str) -> EvalGraderConfig:
        """The grader endpoint of ``benchmark``: its eval.graders entry, else eval.grader."""
        return self.graders.get(benchmark) or self.grader

    def protocol_for(self, benchmark: str) -> str | None:
        """The grading protocol of a benchmark that has a choice (EVAL_PROTOCOLS), else None."""
        entry = self.graders.get(benchmark)
        if entry is not None and entry.protocol is not None:
            return entry.protocol
        setting = EVAL_PROTOCOL_SETTINGS.get(benchmark)
        return getattr(self, setting) if setting else None

    @field_validator("max_queries")
    @classmethod
    def _positive_or_all(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"max_queries must be at least 1 or 'all', got {value}")
        return value

    @field_validator("benchmarks")
    @classmethod
    def _known_benchmarks(cls, value: list[str]) -> list[str]:
        check_known(value, EVAL_BENCHMARKS, "unknown benchmarks {unknown}; choose from {known}")
        return value

    @field_validator("paths")
    @classmethod
    def _known_paths(cls, value: dict[str, str]) -> dict[str, str]:
        known = [b for b in EVAL_BENCHMARKS if b != "synthetic"] + list(EVAL_EXTRA_PATHS)
        check_known(value, known, "paths has unknown benchmarks {unknown}; choose from {known}")
        return value
