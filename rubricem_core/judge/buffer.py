"""The evolving rubric buffer of one query.

Persistent rubrics come from the training data (answer stage) and are never removed. Adaptive
rubrics are added by the judge each step (deduplicated by normalized title) and pruned after the
group is scored: a rubric whose scores do not vary across the group carries no signal for a
group-relative advantage, and when a stage holds more than ``cap_per_stage`` adaptive rubrics only
the most discriminative (highest score std across the group) stay.

Every change is kept on the rubric itself (status, created_step, pruned_step), so ``rows(step)``
gives the ``judge_rubrics`` partition of a step: the rubrics in force during it plus those pruned
at it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from rubricem_core.judge.prompts import GeneratedRubric
from rubricem_core.judge.types import JudgeError, Rubric, TrajectoryJudgment
from rubricem_core.scaffold import STAGE_IDS, STAGES

MIN_GROUP_FOR_PRUNING = 2  # one valid judgment cannot show whether a rubric varies


class RubricBuffer:
    def __init__(self, query_id: str, persistent: Iterable[Rubric] = (), cap_per_stage: int = 5) -> None:
        if not isinstance(cap_per_stage, int) or cap_per_stage < 0:
            raise JudgeError(f"cap_per_stage must be an int >= 0, got {cap_per_stage!r}")
        self.query_id = query_id
        self.cap_per_stage = cap_per_stage
        self._rubrics: dict[str, Rubric] = {}  # rubric_id → rubric, insertion order = creation order
        for rubric in persistent:
            if rubric.origin != "persistent":
                raise JudgeError(f"rubric {rubric.rubric_id!r} passed as persistent has origin {rubric.origin!r}")
            self._insert(rubric)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_query(
        cls, query_id: str, rubrics: Sequence[dict[str, Any]], cap_per_stage: int = 5, step: int = 0
    ) -> RubricBuffer:
        """From the ``rubrics`` of a ``queries`` row (dicts with title, description, weight, polarity,
        stage and an optional ``check`` dict or JSON string)."""
        persistent = []
        for index, record in enumerate(rubrics):
            missing = [k for k in ("title", "weight", "polarity", "stage") if record.get(k) is None]
            if missing:
                raise JudgeError(f"query {query_id!r} rubric {index}: missing fields {missing}")
            check = record.get("check")
            if isinstance(check, str):
                try:
                    check = json.loads(check)
                except json.JSONDecodeError as exc:
                    raise JudgeError(f"query {query_id!r} rubric {index}: check is not JSON: {exc}") from exc
            persistent.append(
                Rubric.create(
                    query_id,
                    record["stage"],
                    record["polarity"],
                    record["title"],
                    record.get("description") or "",
                    record["weight"],
                    "persistent",
                    step,
                    check,
                )
            )
        return cls(query_id, persistent, cap_per_stage)

    def _insert(self, rubric: Rubric) -> None:
        if rubric.query_id != self.query_id:
            raise JudgeError(f"rubric {rubric.rubric_id!r} belongs to query {rubric.query_id!r}, not {self.query_id!r}")
        existing = self._rubrics.get(rubric.rubric_id)
        if existing is not None and existing.status == "active":
            return  # same criterion twice (persistent data may repeat a title)
        self._rubrics[rubric.rubric_id] = rubric

    # ---- queries -----------------------------------------------------------------------------
    def active(self, stage: str | None = None) -> list[Rubric]:
        """Active rubrics (copies), persistent first, each group in creation order."""
        if stage is not None and stage not in STAGE_IDS:
            raise JudgeError(f"unknown stage {stage!r}; expected one of {STAGES}")
        out = [r for r in self._rubrics.values() if r.status == "active" and (stage is None or r.stage == stage)]
        out.sort(key=lambda r: (r.origin != "persistent", STAGE_IDS[r.stage]))
        return [dataclasses.replace(r) for r in out]

    def all(self) -> list[Rubric]:
        return [dataclasses.replace(r) for r in self._rubrics.values()]

    def __len__(self) -> int:
        return sum(r.status == "active" for r in self._rubrics.values())

    # ---- updates -----------------------------------------------------------------------------
    def add(self, new_rubrics: Iterable[Rubric | GeneratedRubric], step: int) -> list[Rubric]:
        """Add adaptive rubrics; a title (normalized) already active in the buffer is skipped.

        A rubric pruned earlier and proposed again comes back as active from ``step`` on.
        """
        # One criterion, one place: titles are deduplicated across stages and polarities too.
        active_keys = {r.key for r in self._rubrics.values() if r.status == "active"}
        added: list[Rubric] = []
        for item in new_rubrics:
            if isinstance(item, GeneratedRubric):
                rubric = Rubric.create(
                    self.query_id,
                    item.stage,
                    item.polarity,
                    item.title,
                    item.description,
                    item.weight,
                    "adaptive",
                    step,
                    item.check,
                )
            elif isinstance(item, Rubric):
                rubric = dataclasses.replace(
                    item, origin="adaptive", status="active", created_step=step, pruned_step=None
                )
            else:
                raise JudgeError(f"cannot add {type(item).__name__} to a RubricBuffer; expected Rubric")
            if rubric.key in active_keys:
                continue
            self._insert(rubric)
            active_keys.add(rubric.key)
            added.append(dataclasses.replace(rubric))
        return added

    def after_scoring(self, judgments: Sequence[TrajectoryJudgment], step: int) -> list[Rubric]:
        """Prune adaptive rubrics that did not discriminate, then enforce the per-stage cap.

        Failed judgments are left out. Rubrics with fewer than two valid scores are kept (nothing
        to compare). Returns the rubrics pruned at ``step``.
        """
        valid = [j for j in judgments if not j.failed]
        spread: dict[str, float] = {}
        pruned: list[Rubric] = []
        for rubric in self._rubrics.values():
            if rubric.status != "active" or rubric.origin != "adaptive":
                continue
            scores = [s for s in (j.score_of(rubric.rubric_id) for j in valid) if s is not None]
            if len(scores) < MIN_GROUP_FOR_PRUNING:
                spread[rubric.rubric_id] = float("inf")  # unknown: rank it as worth keeping
                continue
            spread[rubric.rubric_id] = float(np.std(scores))
            if len(set(scores)) == 1:
                self._prune(rubric, step)
                pruned.append(rubric)
        for stage in STAGES:
            alive = [
                r
                for r in self._rubrics.values()
                if r.status == "active" and r.origin == "adaptive" and r.stage == stage
            ]
            if len(alive) <= self.cap_per_stage:
                continue
            # Most discriminative first; ties go to the heavier, then the older rubric (stability).
            alive.sort(key=lambda r: (-spread.get(r.rubric_id, float("inf")), -r.weight, r.created_step))
            for rubric in alive[self.cap_per_stage :]:
                self._prune(rubric, step)
                pruned.append(rubric)
        return [dataclasses.replace(r) for r in pruned]

    def _prune(self, rubric: Rubric, step: int) -> None:
        rubric.status = "pruned"
        rubric.pruned_step = step

    # ---- persistence -------------------------------------------------------------------------
    def rows(self, step: int) -> list[dict[str, Any]]:
        """``judge_rubrics`` rows of ``step``: rubrics active now and rubrics pruned at this step."""
        out = []
        for rubric in self._rubrics.values():
            in_force = rubric.status == "active" and rubric.created_step <= step
            if not (in_force or rubric.pruned_step == step):
                continue
            out.append(
                {
                    "step": step,
                    "query_id": self.query_id,
                    "rubric_id": rubric.rubric_id,
                    "stage": rubric.stage,
                    "polarity": rubric.polarity,
                    "origin": rubric.origin,
                    "title": rubric.title,
                    "description": rubric.description,
                    "weight": rubric.weight,
                    "status": rubric.status,
                    "created_step": rubric.created_step,
                    "pruned_step": rubric.pruned_step,
                    "check": None if rubric.check is None else json.dumps(rubric.check, ensure_ascii=False),
                }
            )
        return out

    @classmethod
    def from_rows(cls, query_id: str, rows: Sequence[dict[str, Any]], cap_per_stage: int) -> RubricBuffer:
        """The buffer after the last step in ``rows``: the query's ``judge_rubrics`` rows of every step so
        far, in step order. Each step's partition lists the rubrics in force plus those pruned at it, so
        a rubric's newest row is its state and its first row places it in creation order."""
        buffer = cls(query_id, (), cap_per_stage)
        for row in sorted(rows, key=lambda r: r["step"]):  # stable: keeps each partition's own order
            if row["query_id"] != query_id:
                raise JudgeError(f"judge_rubrics row of query {row['query_id']!r} given for {query_id!r}")
            check = row.get("check")
            record = {**row, "check": json.loads(check) if isinstance(check, str) else check}
            buffer._rubrics[row["rubric_id"]] = Rubric.from_dict(record)
        return buffer

    def copy(self) -> RubricBuffer:
        """An independent copy (a step's judge changes copies: rl.session.StepBuffers)."""
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "query_id": self.query_id,
            "cap_per_stage": self.cap_per_stage,
            "rubrics": [r.to_dict() for r in self._rubrics.values()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RubricBuffer:
        for key in ("query_id", "cap_per_stage", "rubrics"):
            if key not in data:
                raise JudgeError(f"RubricBuffer checkpoint lacks field {key!r}")
        buffer = cls(data["query_id"], (), data["cap_per_stage"])
        for record in data["rubrics"]:
            rubric = Rubric.from_dict(record)
            if rubric.query_id != buffer.query_id:
                raise JudgeError(
                    f"RubricBuffer checkpoint of {buffer.query_id!r} holds rubric "
                    f"{rubric.rubric_id!r} of query {rubric.query_id!r}"
                )
            buffer._rubrics[rubric.rubric_id] = rubric
        return buffer
