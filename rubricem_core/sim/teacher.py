"""The built-in teacher: a scripted research agent that writes the full scaffold.

It is registered as a litellm provider (``rubricem-teacher/<anything>``), so the offline default goes
through exactly the code path of a real provider. Like a real model it sees only the chat: the query
and the tool outputs in earlier turns. It never reads the world's ground truth — it finds evidence by
searching and reads facts out of the snippets it was shown (``world.read_facts``), so it can fail: a
fact it never finds is reported as not found.

Each call continues the trajectory by one turn: the plan and first search, then a state evaluation
and the next search, and finally the review and the cited answer. Configurable error rates (skipped
stage, malformed tool call, uncited answer, ungrounded claim) give rejection filtering real work.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from rubricem_core.config import TeacherConfig
from rubricem_core.reflection.format import REFLECTION_SYSTEM, Reflection
from rubricem_core.scaffold import PLAIN_PROMPT_OPENING, extract_tool_calls
from rubricem_core.seeds import TEACHER_TURN, derive_seed
from rubricem_core.sim.facts import read_facts
from rubricem_core.sim.provider import message_text, register_completion_provider

PROVIDER = "rubricem-teacher"

_SNIPPET = re.compile(r'<snippet id="([^"]+)">(.*?)</snippet>', re.S)
_NAME = r"[A-Z][a-z]+(?: [A-Z][a-z]+)*"
_TITLE_PREFIX = re.compile(r"^[^.:<>]{1,80}:\s+")  # snippets read "Title: text"
# Question forms the teacher understands (the language of the synthetic world); anything else gets
# the generic search-browse-answer strategy.
_QUESTION_FORMS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(rf"^Which was founded earlier, ({_NAME}) or ({_NAME})\?$"), "earlier"),
    (re.compile(rf"^Which has more employees, ({_NAME}) or ({_NAME})\?$"), "more"),
    (re.compile(r"^What is the combined number of employees of (.+)\?$"), "sum"),
    (re.compile(r"^Order these organizations by founding year: (.+)\.$"), "sort"),
    (
        re.compile(rf"^In which city is the headquarters of the organization (founded by|that acquired) ({_NAME})\?$"),
        "hop:headquarters",
    ),
    (
        re.compile(rf"^What is the founding year of the organization (founded by|that acquired) ({_NAME})\?$"),
        "hop:founded",
    ),
    (
        re.compile(rf"^In which sector does the organization (founded by|that acquired) ({_NAME}) operate\?$"),
        "hop:sector",
    ),
]
_ATTRIBUTE_WORDS = {
    "founded": "founding year",
    "employees": "number of employees",
    "headquarters": "headquarters city",
    "sector": "sector",
    "founder_of": "organization founded",
    "acquired_by": "acquirer",
}


@dataclass
class Need:
    entity: str | None  # None: depends on an earlier hop not yet resolved
    attribute: str
    value: str | None = None
    doc_id: str | None = None
    evidence: str | None = None


@dataclass
class Task:
    op: str
    needs: list[Need]
    subjects: list[str]
    attribute: str
    hop_relation: str | None = None


@dataclass
class ErrorPlan:
    """Which mistakes this trajectory makes, drawn once per trajectory from the configured rates."""

    skip_stage: str | None = None
    malformed_call_at: int | None = None
    uncited: bool = False
    ungrounded: bool = False


@dataclass
class TeacherRates:
    """The teacher's error rates (``TeacherConfig``'s built-in fields) and its tool-call budget."""

    skip_stage_rate: float = 0.0
    malformed_call_rate: float = 0.0
    uncited_rate: float = 0.0
    ungrounded_rate: float = 0.0
    max_tool_calls: int = 10
    style: str = "full"  # "terse": the same tags, facts and sources in fewer words
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: TeacherConfig, max_tool_calls: int = 10) -> TeacherRates:
        """The section's rates (same-named fields); the budget is the run's ``tools.max_tool_calls``."""
        rates = {
            name: getattr(cfg, name)
            for name in ("skip_stage_rate", "malformed_call_rate", "uncited_rate", "ungrounded_rate")
        }
        return cls(**rates, max_tool_calls=max_tool_calls, style=cfg.style)


def _split_names(listing: str) -> list[str]:
    parts = re.split(r",\s*|\s+and\s+", listing)
    return [p.strip() for p in parts if p.strip()]


def understand_question(question: str) -> Task | None:
    """Parse a question of the synthetic world into what must be found (None: unknown form)."""
    q = question.strip()
    for pattern, op in _QUESTION_FORMS:
        m = pattern.match(q)
        if not m:
            continue
        if op in ("earlier", "more"):
            attribute = "founded" if op == "earlier" else "employees"
            subjects = [m.group(1), m.group(2)]
            return Task(op, [Need(s, attribute) for s in subjects], subjects, attribute)
        if op in ("sum", "sort"):
            attribute = "employees" if op == "sum" else "founded"
            subjects = _split_names(m.group(1))
            return Task(op, [Need(s, attribute) for s in subjects], subjects, attribute)
        attribute = op.split(":", 1)[1]
        relation = "founder_of" if m.group(1) == "founded by" else "acquired_by"
        start = m.group(2)
        return Task("lookup", [Need(start, relation), Need(None, attribute)], [start], attribute, relation)
    return None


def _draw_errors(rng: random.Random, rates: TeacherRates) -> ErrorPlan:
    plan = ErrorPlan()
    if rng.random() < rates.skip_stage_rate:
        plan.skip_stage = rng.choice(["plan", "review"])
    if rng.random() < rates.malformed_call_rate:
        plan.malformed_call_at = rng.randint(0, 2)
    plan.uncited = rng.random() < rates.uncited_rate
    plan.ungrounded = rng.random() < rates.ungrounded_rate
    return plan


def resolve_needs(task: Task, outputs: list[str]) -> None:
    """Fill needs from facts read in the snippets shown so far (exact entity names only, so a
    similarly named distractor never answers a need)."""
    for output in outputs:
        for doc_id, body in _SNIPPET.findall(output):
            for fact in read_facts(_TITLE_PREFIX.sub("", body, count=1)):
                for i, need in enumerate(task.needs):
                    if need.value is None and need.entity == fact.entity and need.attribute == fact.attribute:
                        need.value, need.doc_id, need.evidence = fact.value, doc_id, body
                        if task.hop_relation and i == 0:
                            task.needs[1].entity = fact.value


class ScriptedTeacher:
    """Stateless: every call rebuilds the agent's state from the chat, as a model would."""

    def __init__(self, rates: TeacherRates):
        self.rates = rates

    # ---- reading the chat ----------------------------------------------------------------------
    def respond(self, messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
        system = message_text(messages[0]["content"]) if messages and messages[0].get("role") == "system" else ""
        if system == REFLECTION_SYSTEM:
            return write_reflection(message_text(messages[-1]["content"]))
        turn = self._research_turn(messages, params)
        # prompted without the scaffold (an API model evaluated plainly): the same research, no stage text
        return without_stage_text(turn) if system.startswith(PLAIN_PROMPT_OPENING) else turn

    def _research_turn(self, messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
        turns = [m for m in messages if m.get("role") != "system"]
        question = message_text(turns[0]["content"]) if turns else ""
        assistant = [message_text(m["content"]) for m in turns if m["role"] == "assistant"]
        outputs = [message_text(m["content"]) for m in turns[1:] if m["role"] == "user"]
        # The request seed is trajectory seed + round: subtracting the round gives a per-trajectory
        # seed, so the trajectory's mistakes stay the same across its turns.
        seed = int(params.get("seed") or 0) - len(assistant)
        rng = random.Random(seed)
        errors = _draw_errors(rng, self.rates)
        turn_rng = random.Random(derive_seed(seed, TEACHER_TURN, len(assistant)))
        calls = [c for text in assistant for c in extract_tool_calls(text)]
        n_calls = sum(text.count("<call_tool") for text in assistant)
        task = understand_question(question)
        if task is None:
            return self._generic(question, assistant, outputs, n_calls, errors)
        resolve_needs(task, outputs)
        if not assistant:
            return self._plan(question, task, errors) + self._next_call(task, calls, n_calls, errors, turn_rng)
        missing = self._missing(task, calls)
        budget_left = self.rates.max_tool_calls - n_calls
        if missing and budget_left > 0 and "budget exhausted" not in (outputs[-1] if outputs else ""):
            return self._state_evaluation(task, "continue", errors) + self._next_call(
                task, calls, n_calls, errors, turn_rng
            )
        return (
            self._state_evaluation(task, "ready", errors) + self._review(task, errors) + self._answer(task, errors, rng)
        )

    def _missing(self, task: Task, calls: list) -> list[Need]:
        out = []
        for need in task.needs:
            if need.value is not None or need.entity is None:
                continue
            tries = sum(1 for c in calls if need.entity.lower() in c.query.lower())
            if tries < 3:  # give up on a fact after three different attempts
                out.append(need)
        return out

    # ---- writing ------------------------------------------------------------------------------
    def _plan(self, question: str, task: Task, errors: ErrorPlan) -> str:
        if errors.skip_stage == "plan":
            return ""
        if self.rates.style == "terse":
            return self._terse_plan(task)
        what = _ATTRIBUTE_WORDS.get(task.attribute, task.attribute)
        if task.hop_relation:
            rel = "founded by" if task.hop_relation == "founder_of" else "that acquired"
            checklist = [f"- which organization was {rel} {task.subjects[0]}", f"- the {what} of that organization"]
            steps = [
                f"1. Search for {task.subjects[0]} to identify the organization.",
                f"2. Search for that organization's {what}.",
            ]
            analysis = (
                f"The question is a two-step lookup: first the organization {rel} {task.subjects[0]}, then its {what}."
            )
        else:
            checklist = [f"- the {what} of {s}" for s in task.subjects]
            steps = [f"{i}. Search for the {what} of {s}." for i, s in enumerate(task.subjects, 1)]
            goal = {
                "earlier": "decide which was founded first",
                "more": "decide which is larger",
                "sum": "add the numbers",
                "sort": "order them from earliest to latest",
            }[task.op]
            analysis = f"The question needs the {what} of {len(task.subjects)} organizations and then to {goal}."
        criteria = {
            "earlier": "- compare the two founding years explicitly and name the earlier organization",
            "more": "- compare the two employee counts explicitly and name the larger organization",
            "sum": "- add every employee count and show the total",
            "sort": "- list every organization in order of founding year, earliest first",
            "lookup": "- connect both steps: the organization found in step one is the one described in step two",
        }[task.op]
        return (
            "<structured_plan>\n"
            f"<deep_analysis>{analysis} Implicitly, similarly named organizations must not be confused, "
            "and every fact must come from a retrieved source.</deep_analysis>\n"
            "<rubric>\n"
            f"<knowledge_checklist>\n" + "\n".join(checklist) + "\n</knowledge_checklist>\n"
            f"<analytical_criteria>\n{criteria}\n- cite the source of every fact</analytical_criteria>\n"
            "<negative_constraints>\n- do not use facts about similarly named entities\n"
            "- do not state a value that no retrieved document supports</negative_constraints>\n"
            "</rubric>\n"
            "<research_plan>\n" + "\n".join(steps) + "\n</research_plan>\n"
            "</structured_plan>\n"
        )

    def _terse_plan(self, task: Task) -> str:
        """The plan's every tag and checklist line, each said once: the judge's plan rubrics look for the
        entity and the attribute in the checklist and research steps, nothing more."""
        what = _ATTRIBUTE_WORDS.get(task.attribute, task.attribute)
        if task.hop_relation:
            rel = "founded by" if task.hop_relation == "founder_of" else "that acquired"
            checklist = [f"- organization {rel} {task.subjects[0]}", f"- its {what}"]
            steps = [f"1. Search {task.subjects[0]}.", f"2. Search that organization's {what}."]
            analysis = "Two-step lookup."
        else:
            checklist = [f"- {what} of {s}" for s in task.subjects]
            steps = [f"{i}. Search {s} {what}." for i, s in enumerate(task.subjects, 1)]
            analysis = {"earlier": "Compare.", "more": "Compare.", "sum": "Add up.", "sort": "Sort."}[task.op]
        return (
            f"<structured_plan>\n<deep_analysis>{analysis}</deep_analysis>\n<rubric>\n"
            "<knowledge_checklist>\n" + "\n".join(checklist) + "\n</knowledge_checklist>\n"
            "<analytical_criteria>\n- cite each fact</analytical_criteria>\n"
            "<negative_constraints>\n- no look-alikes</negative_constraints>\n</rubric>\n"
            "<research_plan>\n" + "\n".join(steps) + "\n</research_plan>\n</structured_plan>\n"
        )

    def _next_call(self, task: Task, calls: list, n_calls: int, errors: ErrorPlan, rng: random.Random) -> str:
        need = self._missing(task, calls)[0]
        assert need.entity is not None  # _missing skips needs whose entity is not resolved yet
        previous = [c.query for c in calls if need.entity.lower() in c.query.lower()]
        words = _ATTRIBUTE_WORDS.get(need.attribute, need.attribute)
        if need.attribute == "founder_of":
            words = "founder of"
        candidates = [f"{need.entity} {words}", need.entity, f"{need.entity} profile"]
        query = next((q for q in candidates if q not in previous), candidates[-1])
        if errors.malformed_call_at == n_calls:
            return f"<call_tool>{query}"  # no tool name: the environment answers with an error
        return f'<call_tool name="search">{query}'

    def _state_evaluation(self, task: Task, verdict: str, errors: ErrorPlan) -> str:
        found = [
            f"{n.entity}: {_ATTRIBUTE_WORDS.get(n.attribute, n.attribute)} = {n.value} [{n.doc_id}]"
            for n in task.needs
            if n.value is not None
        ]
        missing = [
            f"{n.entity or 'the organization from step one'}: {_ATTRIBUTE_WORDS.get(n.attribute, n.attribute)}"
            for n in task.needs
            if n.value is None
        ]
        if self.rates.style == "terse":
            lines = [("Found: " + "; ".join(found) + ".") if found else "Found: nothing."]
            if missing:
                lines.append("Missing: " + "; ".join(missing) + ".")
            lines.append(f"Verdict: {verdict}")
            return "<state_evaluation>" + " ".join(lines) + "</state_evaluation>\n"
        lines = ["Evidence so far: " + ("; ".join(found) if found else "nothing relevant yet") + "."]
        if missing:
            lines.append("Still missing: " + "; ".join(missing) + ".")
        if verdict == "ready" and missing:
            lines.append("The remaining facts could not be found within the search budget; I will say so.")
        lines.append(f"Verdict: {verdict}")
        return "<state_evaluation>" + " ".join(lines) + "</state_evaluation>\n"

    def _review(self, task: Task, errors: ErrorPlan) -> str:
        if errors.skip_stage == "review":
            return ""
        mapping = []
        for n in task.needs:
            label = f"{n.entity or 'target organization'} {_ATTRIBUTE_WORDS.get(n.attribute, n.attribute)}"
            mapping.append(f"- {label} → {n.doc_id}" if n.value is not None else f"- {label} → gap: not found")
        thesis = self._conclusion(task) or "The evidence is incomplete."
        if self.rates.style == "terse":
            return (
                "<review>\n<rubric_review>\n" + "\n".join(mapping) + "\n</rubric_review>\n"
                f"<writing_plan><thesis>{thesis}</thesis><outline>Facts, then conclusion.</outline></writing_plan>\n"
                "</review>\n"
            )
        return (
            "<review>\n<rubric_review>\n" + "\n".join(mapping) + "\n</rubric_review>\n"
            f"<writing_plan><thesis>{thesis}</thesis>"
            "<outline>1. State each fact with its source. 2. Give the conclusion.</outline></writing_plan>\n"
            "</review>\n"
        )

    def _conclusion(self, task: Task) -> str | None:
        needs = task.needs
        if any(n.value is None for n in needs):
            return None
        if task.op == "lookup":
            return f"The answer is {needs[1].value} ({needs[0].value})."
        # every value is known (checked above), so every entity is resolved
        values = {
            n.entity: int(n.value.replace(",", "")) for n in needs if n.entity is not None and n.value is not None
        }
        if task.op == "earlier":
            return f"{min(values, key=values.__getitem__)} was founded earlier."
        if task.op == "more":
            return f"{max(values, key=values.__getitem__)} has more employees."
        if task.op == "sum":
            return f"The combined number of employees is {sum(values.values()):,}."
        return "In order of founding year: " + ", ".join(sorted(values, key=values.__getitem__)) + "."

    def _claim(self, need: Need) -> str:
        if need.attribute == "founder_of":
            return f"{need.entity} founded {need.value}"
        if need.attribute == "acquired_by":
            return f"{need.entity} was acquired by {need.value}"
        phrase = {
            "founded": "was founded in",
            "employees": "employs",
            "headquarters": "is headquartered in",
            "sector": "operates in the sector",
        }[need.attribute]
        suffix = " people" if need.attribute == "employees" else ""
        return f"{need.entity} {phrase} {need.value}{suffix}"

    def _answer(self, task: Task, errors: ErrorPlan, rng: random.Random) -> str:
        sentences = []
        found = [n for n in task.needs if n.value is not None]
        wrong = rng.randrange(len(found)) if (errors.ungrounded and found) else None
        for i, n in enumerate(found):
            need = n
            if i == wrong:  # an ungrounded claim: a value its cited source does not state
                assert n.value is not None  # found: the needs with a value
                need = Need(n.entity, n.attribute, _perturb(n.value), n.doc_id)
            claim = self._claim(need)
            sentences.append(f"{claim}." if errors.uncited else f'<cite id="{n.doc_id}">{claim}</cite>.')
        missing = [n for n in task.needs if n.value is None]
        for n in missing:
            sentences.append(
                f"I could not find the {_ATTRIBUTE_WORDS.get(n.attribute, n.attribute)} of "
                f"{n.entity or 'the organization in question'} in the retrieved documents."
            )
        conclusion = self._conclusion(task)
        if conclusion:
            sentences.append(f"Therefore: {conclusion}")
        else:
            sentences.append("Without these facts the question cannot be answered with confidence.")
        return "<answer>" + " ".join(sentences) + "</answer>"

    # ---- questions outside the synthetic world ---------------------------------------------------
    def _generic(self, question: str, assistant: list[str], outputs: list[str], n_calls: int, errors: ErrorPlan) -> str:
        """Search the question, browse the best hit, then answer from what was read, citing it."""
        if not assistant:
            plan = (
                ""
                if errors.skip_stage == "plan"
                else (
                    "<structured_plan>\n"
                    f"<deep_analysis>The user asks: {question.strip()[:300]} The answer must rest on retrieved sources.</deep_analysis>\n"
                    "<rubric>\n<knowledge_checklist>\n- the facts the question asks for\n</knowledge_checklist>\n"
                    "<analytical_criteria>\n- answer the question directly and cite sources\n</analytical_criteria>\n"
                    "<negative_constraints>\n- do not state facts that no retrieved source supports\n</negative_constraints>\n"
                    "</rubric>\n<research_plan>\n1. Search for the question's key terms.\n2. Read the best document.\n</research_plan>\n"
                    "</structured_plan>\n"
                )
            )
            return plan + f'<call_tool name="search">{question.strip()[:200]}'
        snippets = [(d, b) for out in outputs for d, b in _SNIPPET.findall(out)]
        if n_calls == 1 and snippets:
            return (
                "<state_evaluation>The search returned candidate documents; the top one needs a full read. "
                f"Verdict: continue</state_evaluation>\n"
                f'<call_tool name="browse">{snippets[0][0]}'
            )
        best = snippets[:2]
        review = (
            ""
            if errors.skip_stage == "review"
            else (
                "<review>\n<rubric_review>\n"
                + "\n".join(f"- key facts → {d}" for d, _ in best)
                + "\n</rubric_review>\n"
                "<writing_plan><thesis>Answer from the retrieved documents.</thesis><outline>1. Facts with sources.</outline>"
                "</writing_plan>\n</review>\n"
            )
        )
        claims = []
        for d, body in best:
            sentence = re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", body).strip())[0][:300]
            claims.append(sentence if errors.uncited else f'<cite id="{d}">{sentence}</cite>')
        answer = " ".join(claims) if claims else "The retrieved documents do not answer the question."
        return (
            "<state_evaluation>The documents read cover the question as far as the corpus allows. Verdict: ready"
            "</state_evaluation>\n" + review + f"<answer>{answer}</answer>"
        )


_STAGE_TEXT = re.compile(r"<(structured_plan|state_evaluation|review)>.*?</\1>\s*", re.S)


def without_stage_text(turn: str) -> str:
    """A scaffold turn without its plan, state evaluations and review: tool calls and the answer remain."""
    return _STAGE_TEXT.sub("", turn).lstrip()


# ---- reflections (the meta-policy's task) -------------------------------------------------------
_REFLECTION_PROMPT = re.compile(
    r"^Question:\n(?P<question>.*?)\n\nYour earlier attempt:.*?<<<ATTEMPT>>>\n"
    r"(?P<attempt>.*)\n<<<END OF ATTEMPT>>>",
    re.S,
)
_CONCLUSIONS = {
    "earlier": "Says which of {subjects} was founded earlier, from both founding years",
    "more": "Says which of {subjects} has more employees, from both employee counts",
    "sum": "Adds up the employee counts of {subjects} into one total",
    "sort": "Puts {subjects} in order of founding year, oldest first",
    "lookup": "Finds the organization linked to {subjects} before giving its {attribute}",
}


def write_reflection(prompt: str) -> str:
    """The reflection on one attempt, from what the attempt itself shows (the generator's view: the
    question and the raw trajectory, no rubric or score): which searches found which facts, which facts
    it never found, whether the answer cites its sources."""
    match = _REFLECTION_PROMPT.search(prompt)
    question, attempt = (match["question"].strip(), match["attempt"]) if match else (prompt.strip(), "")
    calls = extract_tool_calls(attempt)
    answer = attempt.rsplit("<answer>", 1)[1] if "<answer>" in attempt else None
    task = understand_question(question)
    rubrics, takeaways = [], []
    if task is not None:
        resolve_needs(task, [attempt])  # facts read from the snippets the attempt was shown
        subjects = " and ".join(task.subjects[:3]) if task.subjects else "the organizations asked about"
        for need in task.needs[:4]:
            what = _ATTRIBUTE_WORDS.get(need.attribute, need.attribute)
            entity = need.entity or "the linked organization"
            rubrics.append(f"States the {what} of {entity}, backed by the passage that gives it")
            if need.value is not None:
                query = next((c.query for c in calls if need.entity and need.entity.lower() in c.query.lower()), None)
                how = f'the search "{query[:80]}"' if query else "a search"
                takeaways.append(f"The {what} of {entity} is in {need.doc_id}, found by {how}; open that passage first")
            else:
                takeaways.append(
                    f"The {what} of {entity} was never found; search for {entity} with the words "
                    f'"{what}" and read the best passage in full'
                )
        op = "lookup" if task.op.startswith("hop") or task.op == "lookup" else task.op
        rubrics.append(
            _CONCLUSIONS.get(op, _CONCLUSIONS["lookup"]).format(
                subjects=subjects, attribute=_ATTRIBUTE_WORDS.get(task.attribute, task.attribute)
            )
        )
        rubrics.append(
            f"Does not mix up {task.subjects[0] if task.subjects else 'an organization'} with a similarly named one"
        )
        if len(calls) > 2 * len(task.needs):
            takeaways.append(
                f"{len(calls)} searches for {len(task.needs)} facts: stop searching once each fact is found"
            )
    else:
        rubrics += [
            "Answers what the question asks, each claim tied to a retrieved document",
            "States no fact that no retrieved document supports",
        ]
        if calls:
            takeaways.append(
                f'The first search was "{calls[0].query[:80]}"; try narrower terms if the top passages miss the point'
            )
        else:
            takeaways.append("No search was made; search for the key terms of the question before answering")
    if answer is None:
        takeaways.append("The attempt ended without an answer; always finish with one, saying which facts are missing")
    elif "<cite" not in answer:
        rubrics.append("Cites the document of every fact in the answer")
        takeaways.append("The answer cites nothing; give each fact its document id")
    return Reflection(tuple(rubrics[:8]), tuple(takeaways[:8])).render()


def _perturb(value: str) -> str:
    digits = value.replace(",", "")
    if digits.isdigit():
        return str(int(digits) + 7)
    return value + " Group"


def register_builtin_teacher(cfg: TeacherConfig, max_tool_calls: int = 10) -> None:
    """Register (idempotently) the scripted teacher as the litellm provider ``rubricem-teacher``."""
    teacher = ScriptedTeacher(TeacherRates.from_config(cfg, max_tool_calls))
    register_completion_provider(PROVIDER, teacher.respond)
