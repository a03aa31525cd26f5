"""``rubricem run --dry-run``: what a profile would call — models, keys, tools, trainer, fleet and each
benchmark's grading protocol — read from the config alone. Nothing is called, nothing is written; a key
variable is said to be set or not, never shown."""

from __future__ import annotations

import os
from typing import Any

from rubricem_core.config import RunConfig
from rubricem_core.rl.curriculum import schedule_length

# how each grader family scores (rubricem_core/eval/llm_grader.py), in a line
FAMILY_PROTOCOLS: dict[str, str] = {
    "synthetic": "the world's checkable facts, in process (no grader model)",
    "rubric_points": "each rubric criterion met or not; score = Σ points met / Σ positive points, per example",
    "dimension_criteria": "criteria scored 0-10, weighted within and across the benchmark's dimensions",
    "rubric_properties": "rubric properties 0/1/2, weighted",
    "short_form": "the answer graded correct / incorrect / not attempted against the gold answer",
    "rubric_coverage": "each rubric item rated 1-5; score = mean of (rating - 1) / 4",
    "answer_set": "gold answer parts found; fully correct, precision, recall, F1",
}
PROTOCOL_CHOICES: dict[str, dict[str, str]] = {
    "healthbench": {
        "per_criterion": "one met/not-met grader call per rubric criterion (the official grader's calls)",
        "joint": "one grader call for all of an answer's criteria",
    },
    "deep_research_bench": {
        "race": "RACE: the report, cleaned of its citations first, and the reference report scored on the same "
        "criteria, prompts in the task's language (zh/en); T / (T + R)",
        "absolute": "each criterion scored 0-10 on its own, no reference report",
    },
    "researchrubrics": {
        "binary": "one verdict call per rubric (Satisfied 1 / Not Satisfied 0), long reports read in chunks; "
        "score = Σ w·s / Σ positive w",
        "ternary": "one verdict call per rubric (Satisfied 1 / Partially 0.5 / Not Satisfied 0), long reports "
        "read in chunks; score = Σ w·s / Σ positive w",
    },
}
TOOL_KINDS: dict[str, str] = {
    "local_search": "BM25 (+ dense) search over the run's corpus table",
    "local_browse": "opens a document of the run's corpus",
    "serper": "Google results through serper.dev",
    "semantic_scholar": "Semantic Scholar Graph API paper search",
    "gemini_google_search": "Google Search grounded by Gemini: sources from the response's grounding metadata",
    "web_browse": "fetches a page; public addresses only, unless allow_networks names more",
    "mcp": "a tool of an MCP server",
}


def _key(env: str | None, optional: bool = False) -> str:
    if not env:
        return "no key"
    state = "set" if os.environ.get(env, "").strip() else ("not set (optional)" if optional else "NOT SET")
    return f"key ${env} {state}"


def _endpoint(section: Any) -> str:
    model = str(section.model)
    if model.startswith("rubricem-"):
        return f"{model} (built-in, offline)"
    parts = [model]
    if getattr(section, "api_base", None):
        parts.append(f"at {section.api_base}")
    parts.append(_key(getattr(section, "api_key_env", None)))
    if getattr(section, "api_key_secret_block", None):
        parts.append(f"or Prefect Secret block {section.api_key_secret_block!r}")
    return ", ".join(parts)


def _tool(spec: dict[str, Any]) -> str:
    kind = str(spec.get("kind"))
    what = TOOL_KINDS.get(kind, kind)
    extra = [f"model {spec['model']}"] if spec.get("model") else []
    if kind in ("serper", "gemini_google_search", "semantic_scholar"):
        default_env = {"serper": "SERPER_API_KEY", "gemini_google_search": "GEMINI_API_KEY"}.get(kind, "S2_API_KEY")
        extra.append(_key(spec.get("api_key_env", default_env), optional=kind == "semantic_scholar"))
    return f"{spec.get('name')}: {kind} ({what}){'; ' + ', '.join(extra) if extra else ''}"


def describe_run(cfg: RunConfig) -> str:
    """The lines `rubricem run --dry-run` prints."""
    from rubricem_core.eval.short_form import PROTOCOLS as SHORT_FORM_PROTOCOLS
    from rubricem_core.eval.types import family_of

    lines = [f"profile {cfg.profile}: what a run would call (--dry-run: nothing is called or written)"]
    teacher = cfg.teacher
    lines.append(f"  teacher:          {_endpoint(teacher)}; mode {teacher.mode}")
    lines.append(f"  judge:            {_endpoint(cfg.judge)}")
    lines.append(f"  reflection judge: {_endpoint(cfg.reflection.judge)}")
    specs = [dict(s) if not isinstance(s, dict) else s for s in cfg.tools.specs]
    if specs:
        lines.append("  tools:")
        lines += [f"    {_tool(spec)}" for spec in specs]
    else:
        lines.append("  tools:            local search and browse over the run's corpus (offline)")
    lines.append(
        f"  policy:           {cfg.policy.name_or_path} ({cfg.policy.dtype}); SFT {cfg.sft.backend}, RL {cfg.rl.backend} "
        f"on {cfg.distributed.nproc_per_node} rank(s), recipe {cfg.rl.recipe}, "
        f"{schedule_length(cfg.rl.window, cfg.rl.n_windows)} steps"
    )
    r = cfg.rollout
    fleet = f", {r.replicas} replica(s), weights by {r.weight_transfer}" if r.engine == "vllm_server" else ""
    lines.append(f"  rollouts:         {r.engine}{fleet}, {r.group_size} per query")
    e = cfg.eval
    chosen = "every query (the full sets)" if e.max_queries == "all" else f"{e.max_queries} queries ({e.sample})"
    lines.append(f"  evaluation:       {chosen} per benchmark, retrieval {e.retrieval}")
    for benchmark in e.benchmarks:
        family = family_of(benchmark)
        choice = e.protocol_for(benchmark)
        how = PROTOCOL_CHOICES.get(benchmark, {}).get(choice or "", "")
        if benchmark in SHORT_FORM_PROTOCOLS:
            how = SHORT_FORM_PROTOCOLS[benchmark][2]
        grader = "" if benchmark == "synthetic" else f"; grader {_endpoint(e.grader_for(benchmark))}"
        path = e.paths.get(benchmark)
        where = "" if benchmark == "synthetic" else f"; file {path}" if path else "; file NOT SET (eval.paths)"
        protocol = f"{family} [{choice}]" if choice else family
        lines.append(f"    {benchmark}: {protocol}: {how or FAMILY_PROTOCOLS.get(family, '')}{grader}{where}")
    return "\n".join(lines)
