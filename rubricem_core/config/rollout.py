"""The `rollout` section: engines, sampling, servers and the weight push."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rubricem_core.config.base import _Strict
from rubricem_core.redact import (
    is_secret_name,
    looks_like_secret,
    redact_text,
)


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
