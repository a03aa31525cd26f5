"""`RunConfig`, the whole run: every section, the `distributed` and `tracking` sections, and the checks that
span sections (micro-batch budgets against the longest sequences, work bounds)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from rubricem_core.config.base import _Strict
from rubricem_core.config.data import DataConfig, FilterConfig, ToolsConfig
from rubricem_core.config.endpoints import JudgeConfig, TeacherConfig
from rubricem_core.config.eval import EvalConfig
from rubricem_core.config.reflection import ReflectionConfig
from rubricem_core.config.rollout import RolloutConfig
from rubricem_core.config.training import REFLECTION_RECIPES, PackingSettings, PolicyConfig, RLConfig, SFTConfig

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
        if self.rl.async_steps and self.rl.importance_correction != "tis":
            raise ValueError(
                "rl.async_steps: 1 trains each step on rollouts sampled one update earlier; set "
                "rl.importance_correction: tis, which corrects that lag (min(π_old/π_sampler, rl.tis_cap) per token)"
            )
        if self.rl.async_steps and self.rollout.colocate:
            raise ValueError(
                "rl.async_steps: 1 samples the next step while the trainer updates; rollout.colocate puts vLLM to "
                "sleep during every update: set one of them off"
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
