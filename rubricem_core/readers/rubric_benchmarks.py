"""Benchmarks graded by rubric items: HealthBench, ScholarQA-CS, DeepResearchBench (with its reference
reports), ResearchQA, ResearchRubrics."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from rubricem_core.readers.records import (
    QueryFileError,
    _benchmark_rubric,
    _check_split,
    _Collector,
    _first_record_keys,
    _iter_records,
    _last_user_turn,
    _messages,
    _number,
    _Record,
    _short_title,
)
from rubricem_core.schemas import (
    Query,
)

# ---- HealthBench -------------------------------------------------------------------------------


def read_healthbench(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """HealthBench JSONL: prompt (conversation), prompt_id, rubrics [{criterion, points, tags}]."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        messages = _messages(record, "prompt", record.first("prompt")[1])
        _, items = record.first("rubrics")
        if not isinstance(items, list) or not items:
            raise record.error("rubrics", "expected a non-empty list")
        rubrics = []
        for i, item in enumerate(items):
            field = f"rubrics[{i}]"
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("criterion"), str)
                or not item["criterion"].strip()
            ):
                raise record.error(f"{field}.criterion", "missing or not a string")
            if "points" not in item:
                raise record.error(f"{field}.points", "missing")
            points = _number(record, f"{field}.points", item["points"])
            tags = item.get("tags") or []
            criterion = item["criterion"]
            rubrics.append(
                _benchmark_rubric(_short_title(criterion), criterion, points, "healthbench", points=points, tags=tags)
            )
        ideal = data.get("ideal_completions_data")
        reference = ideal.get("ideal_completion") if isinstance(ideal, dict) else None
        metadata = {"example_tags": data.get("example_tags") or [], "n_turns": len(messages)}
        if isinstance(ideal, dict) and ideal.get("ideal_completions_group"):
            metadata["ideal_completions_group"] = ideal["ideal_completions_group"]
        out.add_long_form(
            where,
            "healthbench",
            record.ident("prompt_id"),
            split,
            question=_last_user_turn(record, "prompt", messages),
            messages=messages,
            rubrics=rubrics,
            reference_answer=reference if isinstance(reference, str) else None,
            metadata=metadata,
        )
    return out.result()


# ---- ScholarQA-CS ------------------------------------------------------------------------------


def read_scholarqa_cs(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """ScholarQA-CS JSON: case_id, initial_prompt, metric_config.config.other_properties[...]."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        question = record.text("initial_prompt")
        config = (
            (data.get("metric_config") or {}).get("config") if isinstance(data.get("metric_config"), dict) else None
        )
        if not isinstance(config, dict):
            raise record.error("metric_config.config", "missing or not an object")
        properties = config.get("other_properties")
        if not isinstance(properties, list):
            raise record.error("metric_config.config.other_properties", "missing or not a list")
        rubrics = []
        for i, item in enumerate(properties):
            field = f"metric_config.config.other_properties[{i}]"
            if not isinstance(item, dict) or not isinstance(item.get("criterion"), str):
                raise record.error(f"{field}.criterion", "missing or not a string")
            weight = _number(record, f"{field}.weight", item.get("weight"))
            name = item.get("name") if isinstance(item.get("name"), str) else f"item_{i}"
            title = f"{name}: {_short_title(item['criterion'], 60)}"
            evidence = item.get("evidence") or []
            rubrics.append(
                _benchmark_rubric(title, item["criterion"], weight, "scholarqa_cs", name=name, evidence=evidence)
            )
        scalar_config = {k: v for k, v in config.items() if isinstance(v, (int, float, str)) and k != "question"}
        metadata = {
            "metric": (data.get("metric_config") or {}).get("name"),
            "metric_config": scalar_config,
            "annotator": data.get("annotator"),
        }
        out.add_long_form(
            where,
            "scholarqa_cs",
            record.ident("case_id"),
            split,
            question=question,
            rubrics=rubrics,
            metadata=metadata,
        )
    return out.result()


# ---- DeepResearchBench -------------------------------------------------------------------------


def _find_drb_criteria(query_path: Path) -> Path | None:
    for candidate in sorted(query_path.parent.glob("*.jsonl")):
        if candidate != query_path and "criterions" in _first_record_keys(candidate):
            return candidate
    return None


def _drb_rubrics(record: _Record) -> list[dict[str, Any]]:
    _, dim_weights = record.first("dimension_weight")
    _, criterions = record.first("criterions")
    if not isinstance(dim_weights, dict) or not isinstance(criterions, dict):
        raise record.error("dimension_weight|criterions", "expected objects keyed by dimension")
    rubrics = []
    for dimension, items in criterions.items():
        if dimension not in dim_weights:
            raise record.error(f"dimension_weight.{dimension}", "missing weight for a dimension with criteria")
        dim_weight = _number(record, f"dimension_weight.{dimension}", dim_weights[dimension])
        if not isinstance(items, list):
            raise record.error(f"criterions.{dimension}", "expected a list")
        for i, item in enumerate(items):
            field = f"criterions.{dimension}[{i}]"
            if not isinstance(item, dict) or not isinstance(item.get("criterion"), str):
                raise record.error(f"{field}.criterion", "missing or not a string")
            weight = _number(record, f"{field}.weight", item.get("weight"))
            explanation = item.get("explanation") if isinstance(item.get("explanation"), str) else item["criterion"]
            rubrics.append(
                {
                    "title": f"[{dimension}] {_short_title(item['criterion'])}",
                    "description": explanation,
                    "weight": dim_weight * weight,
                    "polarity": "positive",
                    "stage": "answer",
                    "check": {
                        "type": "benchmark",
                        "benchmark": "deep_research_bench",
                        "dimension": dimension,
                        "dimension_weight": dim_weight,
                        "criterion_weight": weight,
                        "criterion": item["criterion"],
                    },
                }
            )
    return rubrics


def read_deep_research_bench(
    path: str | os.PathLike[str], criteria_path: str | os.PathLike[str] | None = None, split: str = "eval"
) -> list[Query]:
    """DeepResearchBench query JSONL (id, topic, language, prompt) joined by id with the criteria JSONL.

    Rubric weight = dimension_weight * criterion weight. `criteria_path` defaults to a sibling JSONL
    whose records carry `criterions`; without one the queries have no rubrics.
    """
    path, split = Path(path), _check_split(split)
    criteria_file = Path(criteria_path) if criteria_path is not None else _find_drb_criteria(path)
    rubrics_by_id: dict[str, list[dict[str, Any]]] = {}
    if criteria_file is not None:
        for where, data in _iter_records(criteria_file):
            record = _Record(criteria_file, where, data)
            rubrics_by_id[record.ident("id")] = _drb_rubrics(record)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        query_id = record.ident("id")
        question = record.text("prompt")
        if criteria_file is not None and query_id not in rubrics_by_id:
            raise QueryFileError(criteria_file, None, f"no criteria for query id {query_id!r} of {path} ({where})")
        metadata = {"topic": data.get("topic"), "language": data.get("language")}
        out.add_long_form(
            where,
            "deep_research_bench",
            query_id,
            split,
            question=question,
            rubrics=rubrics_by_id.get(query_id, []),
            metadata=metadata,
        )
    return out.result()


DRB_REFERENCE_KEY = "reference_article"  # Query.metadata key of a DeepResearchBench reference report


def read_drb_references(path: str | os.PathLike[str]) -> dict[str, str]:
    """DeepResearchBench reference reports (JSONL of id, prompt, article, as the benchmark's
    ``test_data/cleaned_data/reference.jsonl``) → {query_id as ``read_deep_research_bench`` names it: article}.

    RACE grading scores a report relative to its query's reference report. Records are matched by id;
    their ``prompt`` is kept for ``attach_drb_references`` to check against the query's question."""
    return {query_id: article for query_id, (article, _) in _drb_reference_records(Path(path)).items()}


def _drb_reference_records(path: Path) -> dict[str, tuple[str, str | None]]:
    if not path.is_file():
        raise QueryFileError(path, None, "no such file")
    out: dict[str, tuple[str, str | None]] = {}
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        query_id = f"deep_research_bench-{record.ident('id')}"
        if query_id in out:
            raise QueryFileError(path, where, f"field 'id': a second reference for {query_id!r}")
        out[query_id] = (record.text("article"), record.text("prompt", required=False))
    return out


def attach_drb_references(queries: list[Query], path: str | os.PathLike[str]) -> list[Query]:
    """The queries with their reference report in ``metadata["reference_article"]`` (where the file has one;
    the policy's prompt never shows metadata). A reference written for another prompt than its query's
    (a different release of the benchmark) is an error, not a silent mismatch."""
    path = Path(path)
    records = _drb_reference_records(path)
    out = []
    for query in queries:
        found = records.get(query.query_id)
        if found is None:
            out.append(query)
            continue
        article, prompt = found
        if prompt is not None and prompt.strip() != query.question.strip():
            raise QueryFileError(
                path,
                None,
                f"the reference for {query.query_id!r} was written for another prompt "
                f"({prompt[:60]!r} vs {query.question[:60]!r})",
            )
        out.append(dataclasses.replace(query, metadata={**query.metadata, DRB_REFERENCE_KEY: article}))
    return out


# ---- ResearchQA --------------------------------------------------------------------------------
# Format of realliyifei/ResearchQA (HF dataset realliyifei/ResearchQA, test.json / valid.json / full.json;
# loader `researchqa_loader.py` at commit 3ed036d): a JSON list of {id, general_domain, subdomain, field,
# query, date, rubric: [{rubric_item, type}]}. Rubric items carry no weight: ResearchQA's coverage is the
# unweighted mean over them (``eval.prompts``, family rubric_coverage).


def read_researchqa(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """ResearchQA JSON list (or JSONL/Parquet of the same records): id, query, rubric [{rubric_item, type}],
    general_domain, subdomain, field, date."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        question = record.text("query")
        _, items = record.first("rubric")
        if not isinstance(items, list) or not items:
            raise record.error("rubric", "expected a non-empty list of {rubric_item, type}")
        rubrics = []
        for i, item in enumerate(items):
            field = f"rubric[{i}]"
            if not isinstance(item, dict):
                raise record.error(field, f"expected an object, got {type(item).__name__}")
            text = item.get("rubric_item")
            if not isinstance(text, str) or not text.strip():
                raise record.error(f"{field}.rubric_item", "missing or not a non-empty string")
            kind = item.get("type")
            if kind is not None and not isinstance(kind, str):
                raise record.error(f"{field}.type", f"expected a string, got {kind!r:.60}")
            rubrics.append(_benchmark_rubric(_short_title(text), text, 1.0, "researchqa", rubric_type=kind))
        metadata = {k: data.get(k) for k in ("general_domain", "subdomain", "field", "date") if data.get(k) is not None}
        out.add_long_form(
            where,
            "researchqa",
            record.ident("id"),
            split,
            question=question,
            rubrics=rubrics,
            metadata=metadata,
        )
    return out.result()


# ---- ResearchRubrics ---------------------------------------------------------------------------
# Format of ScaleAI/researchrubrics (HF dataset ScaleAI/researchrubrics, processed_data.jsonl; README of
# github.com/scaleapi/researchrubrics at commit 2dc80e2): JSONL of {prompt, sample_id, domain,
# conceptual_breadth, logical_nesting, exploration, rubrics: [{criterion, weight, axis}]}. A weight may be
# negative (an undesirable property): its points count when the criterion is satisfied, as HealthBench's.


def read_researchrubrics(path: str | os.PathLike[str], split: str = "eval") -> list[Query]:
    """ResearchRubrics JSONL (or JSON/Parquet): sample_id, prompt, rubrics [{criterion, weight, axis}], domain and
    the three complexity labels."""
    path, split = Path(path), _check_split(split)
    out = _Collector(path)
    for where, data in _iter_records(path):
        record = _Record(path, where, data)
        question = record.text("prompt")
        _, items = record.first("rubrics")
        if isinstance(items, str):  # the compiled CSV/Parquet export keeps rubrics as a JSON string
            try:
                items = json.loads(items)
            except json.JSONDecodeError:
                raise record.error("rubrics", "expected a list of {criterion, weight, axis} (or its JSON)") from None
        if not isinstance(items, list) or not items:
            raise record.error("rubrics", "expected a non-empty list of {criterion, weight, axis}")
        rubrics = []
        for i, item in enumerate(items):
            field = f"rubrics[{i}]"
            if not isinstance(item, dict):
                raise record.error(field, f"expected an object, got {type(item).__name__}")
            if not isinstance(item.get("criterion"), str) or not item["criterion"].strip():
                raise record.error(f"{field}.criterion", "missing or not a non-empty string")
            if item.get("weight") is None:
                raise record.error(f"{field}.weight", "missing")
            weight = _number(record, f"{field}.weight", item["weight"])
            axis = item.get("axis")
            if axis is not None and not isinstance(axis, str):
                raise record.error(f"{field}.axis", f"expected a string, got {axis!r:.60}")
            criterion = item["criterion"]
            check = {"points": weight, "axis": axis}
            rubrics.append(_benchmark_rubric(_short_title(criterion), criterion, weight, "researchrubrics", **check))
        labels = ("domain", "conceptual_breadth", "logical_nesting", "exploration")
        out.add_long_form(
            where,
            "researchrubrics",
            record.ident("sample_id"),
            split,
            question=question,
            rubrics=rubrics,
            metadata={k: data[k] for k in labels if data.get(k) is not None},
        )
    return out.result()
