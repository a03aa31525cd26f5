"""`rubricem ask`: one question of one's own to a trained policy, its trajectory shown stage by stage
while it is sampled (Plan → Research with each tool call and what it returned → Review → Answer).

What runs is evaluation's: the engine of ``rollout.engine`` (``make_engine``), the run's tools over its
corpus (or the profile's web tools), the policy's prompt style and ``eval.temperature``; with
``retrieval="cross"`` the nearest reflection of the run's bank is put in the prompt, as evaluation's
cross-episode retrieval does. No table is written: asking is reading.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from rubricem_core.config import RunConfig
from rubricem_core.encoding import encode_prompt
from rubricem_core.environment import local_tool_env, prompt_messages, trace_format
from rubricem_core.eval.benchmark import default_checkpoint, load_bank
from rubricem_core.eval.run import guidance_for
from rubricem_core.layout import holds_policy
from rubricem_core.rollout.types import RolloutRequest, SamplingParams, TextPiece
from rubricem_core.scaffold import STAGES, extract_answer, extract_tool_calls, stage_texts, validate
from rubricem_core.schemas import CORPUS_SCHEMA, Query
from rubricem_core.store import RunStore
from rubricem_core.tools.base import ToolEnv


class AskError(ValueError):
    """The question, run directory or checkpoint cannot be asked; the message says what to fix."""


@dataclass
class AskResult:
    question: str
    checkpoint: str
    stages: dict[str, str]  # each stage's policy text (tags included, tool outputs left out)
    tool_calls: list[dict[str, str]]  # {name, query, output} in the order they ran
    answer: str
    finish_reason: str
    valid_scaffold: bool
    violations: list[str]
    policy_tokens: int
    seconds: float
    guidance: str | None = None
    text: str = field(default="", repr=False)  # the whole generated text

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=2)


def resolve_checkpoint(store: RunStore, checkpoint: str | None) -> Path:
    """``None``: evaluation's default (the newest finished RL step's checkpoint, else SFT); ``sft``; ``step:N``
    (an RL step's checkpoint); or a policy directory."""
    if checkpoint is None:
        try:
            return default_checkpoint(store)
        except FileNotFoundError as exc:
            raise AskError(str(exc)) from None
    if checkpoint == "sft":
        path = store.layout.sft_final
    elif re.fullmatch(r"step:\d+", checkpoint):
        path = store.layout.rl_step_checkpoint(int(checkpoint.split(":")[1]))
    else:
        path = Path(checkpoint)
    if not holds_policy(path):
        raise AskError(
            f"no policy checkpoint at {path} (a directory with config.json or a LoRA adapter; --checkpoint sft, step:N or a path)"
        )
    return path


def run_tools(store: RunStore, cfg: RunConfig) -> ToolEnv:
    """The run's tools: local search and browse over its `corpus` table, or ``tools.specs``'s."""
    if store.files("corpus"):
        corpus = store.read_table("corpus")
    elif cfg.tools.specs:
        corpus = CORPUS_SCHEMA.empty_table()
    else:
        raise AskError(
            f"{store.run_dir} has no corpus table for the local search tool: run `rubricem run` (or collect-sft-data) first"
        )
    return local_tool_env(corpus, cfg.tools)


def bank_guidance(store: RunStore, cfg: RunConfig, question: str, retrieval: str) -> str | None:
    """The reflection the run's bank returns for ``question`` (``cross``), or None (``none``, or a miss)."""
    if retrieval == "none":
        return None
    if retrieval != "cross":
        raise AskError(f"--retrieval must be none or cross for one question, got {retrieval!r}")
    query = Query("ask", "ask", "eval", "long_form", question, [{"role": "user", "content": question}])
    return guidance_for(load_bank(store.run_dir, cfg, retrieval), [query], retrieval)["ask"]


def ask(
    engine: Any,
    tokenizer: Any,
    question: str,
    env: ToolEnv,
    cfg: RunConfig,
    *,
    checkpoint: str = "",
    guidance: str | None = None,
    on_text: Callable[[TextPiece], None] | None = None,
    seed: int | None = None,
) -> AskResult:
    """Sample one trajectory for ``question``; ``on_text`` sees every piece of it as it is known."""
    if not question.strip():
        raise AskError("the question is empty")
    messages = prompt_messages({"question": question.strip()}, guidance=guidance, style=cfg.policy.prompt_style)
    sampling = SamplingParams(
        temperature=cfg.eval.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=seed,
    )
    request = RolloutRequest(
        "ask",
        encode_prompt(tokenizer, messages),
        sampling=sampling,
        max_tool_calls=cfg.tools.max_tool_calls,
        on_text=on_text,
    )
    t0 = time.perf_counter()
    traj = engine.generate([request], env)[0][0]
    seconds = time.perf_counter() - t0
    text = "".join(s.text for s in traj.segments if s.kind != "prompt")
    outputs = [s.text for s in traj.segments if s.kind == "tool_output"]
    calls = extract_tool_calls(text)
    texts = stage_texts(text)
    return AskResult(
        question=question.strip(),
        checkpoint=checkpoint,
        stages={stage: texts.get(stage, "") for stage in STAGES},
        tool_calls=[
            {"name": c.name, "query": c.query, "output": outputs[i] if i < len(outputs) else ""}
            for i, c in enumerate(calls)
        ],
        answer=extract_answer(text) or "",
        finish_reason=traj.finish_reason,
        valid_scaffold=not (
            violations := validate(
                text, tuple(env.tools), cfg.tools.max_tool_calls, trace_format(cfg.policy.prompt_style)
            )
        ),
        violations=[v.message for v in violations],
        policy_tokens=traj.n_policy_tokens,
        seconds=seconds,
        guidance=guidance,
        text=text,
    )


# ---- the terminal view ---------------------------------------------------------------------------
_TAG = re.compile(r"^</?([a-z_]+)(\s[^>]*)?>$")
_CALL_OPEN = re.compile(r'^<call_tool\s+name="([^"]*)"[^>]*>$')
_SNIPPET_OPEN = re.compile(r'<snippet id="([^"]*)">')
_SNIPPET_CLOSE = re.compile(r"</snippet>")
_TITLES = {"plan": "Plan", "research": "Research", "review": "Review", "answer": "Answer"}


class LiveView:
    """Prints a trajectory as its pieces arrive: a rule at each new stage, tags dimmed, each tool call on
    its own line and, per snippet it returned, its id and first ``max_output_chars`` characters. Colours only on a terminal
    (rich decides; ``NO_COLOR`` is honoured)."""

    def __init__(self, file: IO[str] | None = None, max_output_chars: int = 160) -> None:
        from rich.console import Console

        self.console = Console(file=file, highlight=False, soft_wrap=True)
        self.max_output_chars = max_output_chars
        self.stage: str | None = None
        self.in_call = False
        self.output_chars = 0

    def header(self, question: str, checkpoint: str, guidance: str | None) -> None:
        self.console.print(f"[bold]question[/bold]  {_escape(question)}")
        self.console.print(f"[bold]policy[/bold]    {_escape(checkpoint)}")
        if guidance:
            self.console.print(f"[bold]guidance[/bold]  {_escape(' '.join(guidance.split())[:200])}")

    def __call__(self, piece: TextPiece) -> None:
        out = self.console
        if piece.in_tool_output:
            self._tool_output(piece.text)
            return
        if piece.stage != self.stage:
            self.stage = piece.stage
            out.print()
            out.rule(f"[bold]{_TITLES.get(piece.stage, piece.stage)}[/bold]", align="left")
        text = piece.text
        call = _CALL_OPEN.match(text)
        if call:
            self.in_call = True
            out.print(f"\n[bold cyan]→ {_escape(call.group(1))}[/bold cyan] ", end="")
        elif text == "</call_tool>":
            self.in_call = False
            out.print()
        elif _TAG.match(text):
            out.print(text, style="dim", end="", markup=False)
        else:
            out.print(text, style="cyan" if self.in_call else None, end="", markup=False)

    def _tool_output(self, text: str) -> None:
        if text.startswith("<tool_output"):
            self.output_chars = 0
            self.console.print("  [dim]← returned[/dim]", end="")
            return
        if text == "</tool_output>":
            self.console.print()
            return
        text = _SNIPPET_CLOSE.sub("", _SNIPPET_OPEN.sub(r"\n    [\1] ", text))  # one line a snippet, its id first
        for line in text.split("\n"):
            if line.startswith("    ["):
                self.output_chars = 0  # each snippet gets its own room
                self.console.print()
            room = self.max_output_chars - self.output_chars
            if room > 0:
                shown = " ".join(line.split())
                indent = "    " if line.startswith("    [") else ""
                self.console.print(indent + shown[:room], style="dim", end="", markup=False)
                if len(shown) > room:
                    self.console.print(" …", style="dim", end="")
            self.output_chars += len(line)

    def footer(self, result: AskResult) -> None:
        out = self.console
        out.print()
        out.rule(style="dim")
        verdict = "valid scaffold" if result.valid_scaffold else f"invalid scaffold ({len(result.violations)} problems)"
        out.print(
            f"{result.finish_reason} · {len(result.tool_calls)} tool calls · {verdict} · "
            f"{result.policy_tokens} tokens in {result.seconds:.1f} s"
        )
        for message in result.violations[:3]:
            out.print(f"  [dim]- {_escape(message)}[/dim]")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
