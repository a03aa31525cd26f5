"""Per-GPU memory of a training set-up, before running it: weights, gradients, optimizer, activations,
reference model and the rollout engine's share.

    plan = memory_plan(ModelShape.from_config(json.load(open("config.json"))), TrainSetup(n_gpus=8, zero_stage=3))
    plan.total, plan.as_dict()

The model's parameters come from its shape (a Llama/Qwen decoder: embeddings, attention with grouped
KV heads, a gated MLP, RMS norms). The ZeRO terms are DeepSpeed's partitioning: stage ≥ 1 splits the
optimizer state (fp32 Adam moments and fp32 master weights, which ZeRO keeps even in fp32) over the ranks,
stage ≥ 2 the gradients, stage 3 the weights; offload moves the optimizer state (and at ZeRO-3 the
weights) to host memory. Activations are the tensors autograd keeps for the backward pass of one
micro-batch (``saved_activation_bytes``, which bench/distributed_scaling.py checks against the tensors
a tiny model really saves) plus what the backward adds at its peak (``activation_bytes``); with gradient
checkpointing only each layer's input is kept, plus one layer's tensors while it is recomputed. Buffers DeepSpeed allocates (buckets, prefetch), the CUDA
context and fragmentation are not in the plan: keep 10-15% of a GPU free for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + 2 * self.head_dim  # q,k,v,o projections; q/k norms (Qwen3)
        mlp = 3 * h * self.intermediate  # gate, up, down
        per_layer = attention + mlp + 2 * h  # two RMS norms
        embeddings = self.vocab * h * (1 if self.tied else 2)
        return self.layers * per_layer + embeddings + h  # final norm


def layer_saved_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, seq_len: int, fused_attention: bool) -> int:
    """Bytes autograd keeps for one decoder layer's backward, for a micro-batch of ``tokens`` tokens in
    sequences of ``seq_len`` (itemised from what a Qwen3 layer saves in transformers): per RMS norm its
    input, normalised output and the projection's reshaped input (3 h) and the inverse RMS; q and k
    before their norms, after them and after the rotary embedding (3 q + 3 kv); v; attention's output and
    o_proj's input (2 q); gate, up, silu(gate) and their product (4 m). Fused attention (flash /
    memory-efficient SDPA) adds its fp32 log-sum-exp per head, unfused attention (the math path) its
    (heads × seq_len) probabilities per token."""
    h, q, kv, m = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    elements = 6 * h + 5 * q + 4 * kv + 4 * m + 2 + shape.heads + shape.kv_heads
    attention = shape.heads * 4 if fused_attention else shape.heads * seq_len * dtype_bytes
    return tokens * (elements * dtype_bytes + attention)


def saved_activation_bytes(
    shape: ModelShape, tokens: int, dtype_bytes: int, checkpointing: bool, seq_len: int, fused_attention: bool = True
) -> int:
    """What the forward pass of one micro-batch leaves for the backward: every layer's tensors (with
    checkpointing: only each layer's input), the final norm's, the token ids, the rotary tables and the
    logits."""
    if checkpointing:
        layers = shape.layers * tokens * shape.hidden * dtype_bytes
    else:
        layers = shape.layers * layer_saved_bytes(shape, tokens, dtype_bytes, seq_len, fused_attention)
    once = tokens * ((3 * shape.hidden + 1) * dtype_bytes + 8) + 2 * seq_len * shape.head_dim * dtype_bytes
    return layers + once + tokens * shape.vocab * dtype_bytes


LOGPROB_CHUNK = 1024  # positions per float32 log-softmax chunk (rubricem_core.logprobs.token_logprobs)


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    dtype_bytes: int,
    checkpointing: bool,
    seq_len: int | None = None,
    fused_attention: bool = True,
) -> int:
    """Peak activation memory of one micro-batch: what the forward saves, plus during the backward the
    logits' gradient, one float32 log-softmax chunk with its gradient and, with checkpointing, the
    recomputed tensors of one layer."""
    seq_len = tokens if seq_len is None else seq_len
    peak = saved_activation_bytes(shape, tokens, dtype_bytes, checkpointing, seq_len, fused_attention)
    peak += tokens * shape.vocab * dtype_bytes + 2 * LOGPROB_CHUNK * shape.vocab * 4
    if checkpointing:
        peak += layer_saved_bytes(shape, tokens, dtype_bytes, seq_len, fused_attention)
    return peak


@dataclass(frozen=True)
class TrainSetup:
    n_gpus: int  # data-parallel trainer ranks
    zero_stage: int = 3
    precision: str = "bf16"  # bf16: bf16 weights and gradients, fp32 master weights and Adam moments
    offload: bool = False  # optimizer state in host memory
    offload_params: bool = False  # ZeRO-3 weights in host memory
    gradient_checkpointing: bool = True
    micro_batch_tokens: int = 16384  # padded tokens of one micro-batch (rl/sft.max_tokens_per_batch)
    seq_len: int = 16384  # longest sequence in it (policy.max_seq_len)
    reference: str = "replicated"  # replicated | sharded | cpu | none
    engine_fraction: float = 0.0  # share of each trainer GPU given to a colocated rollout engine
    gpu_bytes: int = 80 * 2**30
    lora_rank: int = 0  # > 0: LoRA adapters of this rank on every linear layer train; the base stays frozen


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    reference: int
    engine: int
    gpu_bytes: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reference + self.engine

    @property
    def fits(self) -> bool:
        return self.total <= 0.9 * self.gpu_bytes  # 10% for DeepSpeed's buffers, the CUDA context, fragmentation

    def as_dict(self) -> dict[str, int]:
        return {**{k: v for k, v in asdict(self).items() if k != "gpu_bytes"}, "total": self.total}


def lora_params(shape: ModelShape, rank: int) -> int:
    """Parameters of rank-``rank`` LoRA adapters on every linear layer of the decoder (q, k, v, o, gate, up,
    down): r × (in + out) each (A is r × in, B is out × r)."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return shape.layers * rank * per_layer


def memory_plan(shape: ModelShape, setup: TrainSetup) -> MemoryPlan:
    """Per-GPU bytes. With ``lora_rank`` the base weights are frozen (no gradients, no optimizer state) and
    only the adapters train; the KL reference is the same model with its adapters off, so it costs nothing."""
    p, n, stage = shape.params, setup.n_gpus, setup.zero_stage
    w = BYTES[setup.precision]
    trained = lora_params(shape, setup.lora_rank) if setup.lora_rank > 0 else p
    held = p + trained if setup.lora_rank > 0 else p
    weights = 0 if setup.offload_params else held * w // (n if stage == 3 else 1)
    gradients = trained * w // (n if stage >= 2 else 1)
    # two fp32 Adam moments, plus the fp32 master partition ZeRO keeps even when training in fp32
    # (bench/distributed_scaling.py measures both in DeepSpeed's optimizer on 2 ranks)
    master = 4 if (setup.precision == "bf16" or stage >= 1) else 0
    adam = trained * (4 + 4 + master)
    optimizer = 0 if setup.offload else adam // (n if stage >= 1 else 1)
    activations = activation_bytes(shape, setup.micro_batch_tokens, w, setup.gradient_checkpointing, setup.seq_len)
    reference = {"replicated": p * w, "sharded": p * w // n, "cpu": 0, "none": 0}[setup.reference]
    if setup.lora_rank > 0:
        reference = 0  # the base with its adapters disabled
    engine = int(setup.engine_fraction * setup.gpu_bytes)
    return MemoryPlan(weights, gradients, optimizer, activations, reference, engine, setup.gpu_bytes)


# ---- the rollout fleet: vLLM replicas beside the trainer, or colocated with it ----------------------
def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tensor_parallel_size: int) -> int:
    """KV-cache bytes one token takes on each GPU of a tensor-parallel replica: K and V of every layer
    for this GPU's share of the KV heads (a KV head is replicated when there are more GPUs than heads)."""
    heads_per_gpu = -(-shape.kv_heads // tensor_parallel_size)
    return 2 * shape.layers * heads_per_gpu * shape.head_dim * dtype_bytes


@dataclass(frozen=True)
class RolloutSetup:
    tensor_parallel_size: int = 1  # GPUs of one replica (rollout.tensor_parallel_size)
    gpu_memory_utilization: float = 0.9  # vLLM's share of each of its GPUs (rollout.gpu_memory_utilization)
    max_model_len: int = 16384  # rollout.max_total_tokens
    dtype: str = "bf16"
    gpu_bytes: int = 80 * 2**30
    runtime_bytes: int = 2 * 2**30  # vLLM's activation peak, CUDA graphs and sampler buffers (not modelled)


@dataclass(frozen=True)
class ReplicaPlan:
    weights: int  # per GPU of the replica
    kv_cache: int  # per GPU: what vLLM's budget leaves for the KV cache
    kv_bytes_per_token: int  # per GPU
    max_model_len: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the replica's KV cache holds at once (all sequences together)."""
        return max(0, self.kv_cache) // self.kv_bytes_per_token

    @property
    def full_sequences(self) -> int:
        """Sequences of ``max_model_len`` tokens the replica can hold at once (rows in flight at worst)."""
        return self.kv_tokens // self.max_model_len

    @property
    def fits(self) -> bool:
        return self.full_sequences >= 1  # vLLM refuses to start without room for one longest sequence

    def as_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "kv_cache": self.kv_cache,
            "kv_tokens": self.kv_tokens,
            "full_sequences": self.full_sequences,
        }


def replica_plan(shape: ModelShape, setup: RolloutSetup, budget_bytes: int | None = None) -> ReplicaPlan:
    """One vLLM replica: its weights split over its GPUs, and the KV cache the rest of its budget (``budget_bytes``
    per GPU, default gpu_memory_utilization × the GPU) holds after the weights and vLLM's runtime."""
    w = BYTES[setup.dtype]
    budget = int(setup.gpu_memory_utilization * setup.gpu_bytes) if budget_bytes is None else budget_bytes
    weights = shape.params * w // setup.tensor_parallel_size
    kv = budget - weights - setup.runtime_bytes
    per_token = kv_bytes_per_token(shape, w, setup.tensor_parallel_size)
    return ReplicaPlan(weights, kv, per_token, setup.max_model_len)


@dataclass(frozen=True)
class FleetPlan:
    trainer_gpus: int
    replicas: int
    trainer: MemoryPlan  # per trainer GPU (while it updates)
    replica: ReplicaPlan  # per replica GPU (while it samples)
    colocated: bool
    # colocated: a GPU while the engine samples (the trainer's resident state + the engine) and while the
    # trainer updates (its whole plan; the engine asleep, level 1: weights in host memory, no KV cache)
    sampling_peak: int
    update_peak: int

    @property
    def fits(self) -> bool:
        limit = 0.9 * self.trainer.gpu_bytes
        return self.replica.fits and self.trainer.fits and max(self.sampling_peak, self.update_peak) <= limit


def fleet_plan(
    shape: ModelShape, train: TrainSetup, rollout: RolloutSetup, total_gpus: int, replicas: int, colocate: bool
) -> FleetPlan:
    """Where a step's GPUs go. Separate: ``replicas`` × tensor_parallel_size GPUs sample, the rest train
    (``train.n_gpus`` is ignored). Colocated (TRL's colocate layout): every GPU trains, and one replica per
    tensor_parallel_size GPUs samples on the same GPUs, its budget gpu_memory_utilization × the GPU while the
    trainer's weights and optimizer state stay resident."""
    tp = rollout.tensor_parallel_size
    if colocate:
        trainer_gpus, replicas = total_gpus, total_gpus // tp
    else:
        trainer_gpus = total_gpus - replicas * tp
        if trainer_gpus < 1:
            raise ValueError(
                f"{replicas} replicas × tensor_parallel_size {tp} = {replicas * tp} GPUs leave none of {total_gpus} "
                "to the trainer"
            )
    trainer = memory_plan(shape, TrainSetup(**{**asdict(train), "n_gpus": trainer_gpus, "engine_fraction": 0.0}))
    replica = replica_plan(shape, rollout)
    resident = trainer.weights + trainer.optimizer + trainer.reference  # gradients are freed after the step
    budget = int(rollout.gpu_memory_utilization * rollout.gpu_bytes)
    sampling = resident + budget if colocate else budget
    return FleetPlan(trainer_gpus, replicas, trainer, replica, colocate, sampling, trainer.total)
