"""The `data`, `tools` and `filter` sections: where queries come from, the research tools, trace filtering."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rubricem_core.config.base import _Strict
from rubricem_core.redact import (
    hold_url_credentials,
    is_env_var_name,
    is_secret_name,
)


class QuerySource(_Strict):
    path: str = Field(description="File with queries (JSONL, Parquet, CSV or JSON, by format).")
    format: str | None = Field(
        default=None,
        description="Reader: dr_tulu, healthbench, scholarqa_cs, deep_research_bench, simpleqa, 2wiki, "
        "searcharena, openscholar (SFT sources), jsonl, parquet. None guesses from the file's content.",
    )
    split: Literal["train", "sft", "eval"] = Field(
        default="train",
        description="Split assigned to these queries: train (RL, and SFT unless data.sft_split says otherwise), "
        "sft (SFT data collection only) or eval (held out).",
    )
    limit: int | None = Field(default=None, ge=1, description="Keep only the first N queries.")


QueryKind = Literal["comparison", "multi_hop", "aggregation", "timeline"]
ALL_QUERY_KINDS: tuple[str, ...] = ("comparison", "multi_hop", "aggregation", "timeline")


class WorldConfig(BaseModel):  # the generator is sim/world.py
    """Parameters of a synthetic research world; the same config always yields the same bytes."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not a silent default

    seed: int = Field(0, description="Random seed; the whole world is a pure function of the config.")
    n_documents: int = Field(2000, ge=50, le=100_000, description="Number of passages in the rendered corpus (exact).")
    n_queries: int = Field(
        200, ge=1, description="Number of queries to generate (fewer only if the world is too small)."
    )
    eval_fraction: float = Field(0.2, ge=0.0, le=1.0, description="Fraction of queries put in the 'eval' split.")
    sft_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of the non-eval queries put in the 'sft' split (SFT data only, apart from RL; "
        "data.sft_split: sft reads them). 0: every non-eval query is 'train'.",
    )
    distractor_rate: float = Field(
        0.2, ge=0.0, le=0.5, description="Fraction of organizations that are confusable distractors of a real one."
    )
    near_duplicate_rate: float = Field(
        0.1, ge=0.0, le=1.0, description="Fraction of organization/person passages that get a re-phrased duplicate."
    )
    query_kinds: list[QueryKind] = Field(
        default_factory=lambda: list(ALL_QUERY_KINDS),  # type: ignore[arg-type]
        description="Query kinds to generate, round-robin.",
    )

    @field_validator("query_kinds")
    @classmethod
    def _non_empty_kinds(cls, kinds: list[str]) -> list[str]:
        if not kinds:
            raise ValueError("query_kinds must name at least one kind")
        return kinds


class DataConfig(_Strict):
    source: Literal["synthetic", "files"] = Field(
        default="synthetic", description="synthetic: the seeded research world; files: queries/corpus below."
    )
    world: WorldConfig = Field(default_factory=WorldConfig, description="Synthetic world settings.")  # type: ignore[arg-type]
    queries: list[QuerySource] = Field(default_factory=list, description="Query files (source=files).")
    corpus: str | None = Field(
        default=None, description="Corpus for the local search tool: JSONL, Parquet, or a folder of .txt/.md."
    )
    sft_split: Literal["train", "sft", "sft+train"] = Field(
        default="train",
        description="Queries the teacher writes SFT traces for: train (the RL queries themselves), sft (the "
        "queries of split sft only, apart from RL: the paper's short- and long-form SFT mix) or sft+train.",
    )
    rl_filter: Literal["none", "long_form"] = Field(
        default="none",
        description="Which train queries RL schedules: none (all) or long_form (the paper: RL on long-form "
        "queries only; a query is long-form unless its reader marked it short_form — SimpleQA, 2Wiki, "
        "exact-answer DR Tulu rows, plain rows with a reference and no rubrics; synthetic queries are long-form).",
    )


class ToolsConfig(_Strict):
    top_k: int = Field(default=5, ge=1, le=50, description="Snippets returned per search.")
    snippet_chars: int = Field(default=300, ge=40, description="Characters per snippet.")
    browse_chars: int = Field(default=4000, ge=100, description="Characters returned by browse.")
    max_tool_calls: int = Field(default=10, ge=1, description="Tool calls allowed per trajectory.")
    embedder: str | None = Field(
        default=None,
        description="Dense retrieval fused with BM25: 'hashing', a sentence-transformers model path, or None.",
    )
    specs: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Explicit tools, replacing the default local search/browse: dicts with name, kind "
        "(local_search, local_browse, serper, semantic_scholar, web_browse, mcp), timeout_s, "
        "max_concurrency, cache and the kind's arguments (see rubricem_core/tools/registry.py).",
    )
    cache_dir: str | None = Field(
        default=None, description="On-disk tool result cache shared across runs (needed by specs with cache: true)."
    )

    @field_validator("specs")
    @classmethod
    def _no_keys_in_specs(cls, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # like an endpoint's: a spec names the variable holding its key, never the key (no value is repeated),
        # and the credentials of its base_url are held in this process, masked in the config
        specs = [
            {**s, "base_url": hold_url_credentials(s["base_url"])}
            if isinstance(s, dict) and isinstance(s.get("base_url"), str)
            else s
            for s in specs
        ]
        for i, spec in enumerate(specs):
            for name, value in spec.items() if isinstance(spec, dict) else ():
                if is_secret_name(name):
                    raise ValueError(
                        f"specs[{i}].{name}: keys are never config fields; name the variable in api_key_env"
                    )
                if name.endswith("_env") and isinstance(value, str) and not is_env_var_name(value):
                    raise ValueError(f"specs[{i}].{name} must name an environment variable, not hold the key itself")
        return specs


class FilterConfig(_Strict):
    min_tool_calls: int = Field(default=1, ge=0, description="Reject traces with fewer tool calls.")
    require_grounding: bool = Field(
        default=True, description="Every cited claim's values must appear in the cited snippet."
    )
    allowed_violations: list[str] = Field(
        default_factory=list, description="Scaffold violation codes that do not reject a trace."
    )
