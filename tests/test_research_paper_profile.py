"""The `research` profile says what it is: the paper's model families as litellm's bundled map names them,
Gemini-grounded Google Search and Semantic Scholar as its search tools, no Batch API job for a Gemini teacher,
and `rubricem run --dry-run` printing every model, tool and grading protocol without calling or writing
anything. `research-drtulu` keeps DR Tulu's choices (tests/test_research_profile.py runs it end to end)."""

from __future__ import annotations

import pytest

from rubricem_core.config import ConfigError, load_config
from rubricem_core.testing.web_search_server import FakeWebSearchServer
from rubricem_core.tools.registry import build_tools

GEMINI_KEY = "AIzaSy-paper-profile-0123456789ab"


def test_the_paper_profile_names_the_papers_models_and_tools():
    import litellm

    cfg = load_config("research")
    assert cfg.teacher.model == "gemini/gemini-3.1-pro-preview" and cfg.teacher.mode == "concurrent"
    assert cfg.judge.model == cfg.reflection.judge.model == "gemini/gemini-3-flash-preview"
    for model in (cfg.teacher.model, cfg.judge.model):
        assert model in litellm.model_cost, f"{model} is not in litellm's bundled model map"
    kinds = {s["name"]: s["kind"] for s in cfg.tools.specs}
    assert kinds == {"search": "gemini_google_search", "paper_search": "semantic_scholar", "browse": "web_browse"}
    drtulu = load_config("research-drtulu")
    assert drtulu.teacher.model == "openai/gpt-4.1" and drtulu.teacher.mode == "batch"
    assert [s["kind"] for s in drtulu.tools.specs] == ["serper", "semantic_scholar", "web_browse"]
    # everything but the models and the search engine is the same recipe
    assert cfg.rl == drtulu.rl and cfg.rollout == drtulu.rollout and cfg.policy == drtulu.policy


def test_a_gemini_teacher_is_refused_a_batch_job_with_the_way_out():
    with pytest.raises(ConfigError, match="mode: batch sends OpenAI-format Batch API jobs.*use mode: concurrent"):
        load_config("research", {"teacher.mode": "batch"})
    assert load_config("research", {"teacher.mode": "batch", "teacher.model": "openai/gpt-4.1"}).teacher.mode == "batch"


def test_the_paper_profiles_tools_search_through_gemini_and_semantic_scholar(monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", GEMINI_KEY)
    monkeypatch.setenv("S2_API_KEY", "s2-key")
    with FakeWebSearchServer(gemini_api_key=GEMINI_KEY, s2_api_key="s2-key") as web:
        base = {"gemini_google_search": f"{web.base_url}/v1beta", "semantic_scholar": f"{web.base_url}/graph/v1"}
        specs = []
        for spec in load_config("research").tools.specs:
            spec = {**spec, "cache": False}
            if spec["kind"] in base:
                spec.update(base_url=base[spec["kind"]], backoff_s=0.0)
            if spec["kind"] == "web_browse":
                spec["allow_networks"] = ["127.0.0.0/8"]
            specs.append(spec)
        tools = build_tools(specs)
        found = tools["search"]("founding year of Fozo Group")
        papers = tools["paper_search"]("founding year of Fozo Group")
        assert found.snippet_ids and papers.snippet_ids and found.error is None and papers.error is None
        assert "Body text of founding-0" in tools["browse"](found.snippet_ids[0]).text
        paths = [r[1] for r in web.requests]
        assert "/v1beta/models/gemini-3-flash-preview:generateContent" in paths and "/graph/v1/paper/search" in paths


def test_dry_run_prints_what_would_be_called_and_touches_nothing(tmp_path, capsys, monkeypatch):
    from flows.cli import main

    monkeypatch.setenv("GEMINI_API_KEY", GEMINI_KEY)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    run_dir = tmp_path / "runs" / "research"
    assert main(["run", "--profile", "research", "--run-dir", str(run_dir), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not run_dir.exists() and not (tmp_path / "runs").exists()
    assert "teacher:          gemini/gemini-3.1-pro-preview, key $GEMINI_API_KEY set" in out
    assert "judge:            gemini/gemini-3-flash-preview" in out and GEMINI_KEY not in out
    assert "search: gemini_google_search (Google Search grounded by Gemini" in out
    assert "paper_search: semantic_scholar" in out and "browse: web_browse" in out
    assert "healthbench: rubric_points [per_criterion]" in out and "key $OPENAI_API_KEY NOT SET" in out
    assert "deep_research_bench: dimension_criteria [race]: RACE" in out
    assert "researchqa: rubric_coverage" in out and "researchrubrics: rubric_points" in out
    assert main(["run", "--profile", "research-drtulu", "--run-dir", str(run_dir), "--dry-run"]) == 0
    drtulu = capsys.readouterr().out
    assert "openai/gpt-4.1, key $OPENAI_API_KEY NOT SET" in drtulu and "mode batch" in drtulu
    assert "search: serper (Google results through serper.dev)" in drtulu
