#!/usr/bin/env bash
# The GPU check of issues #17 and #29: one run on a lent GPU answers what the CPU cannot, one figure per line
# ("gpu_check: name=value unit"), in about 5 minutes on one H200 with no internet.
#
#   bash scripts/gpu_wheels.sh                      # here: DeepSpeed, pydantic, bm25s into .whl/
#   device run, carry [".whl"], timeout_s 600:  bash scripts/gpu_check.sh
#
# 1. tests/test_devices.py (the engine, the trainer and the SS-GRPO update on CUDA vs CPU);
# 2. a random-init Qwen3 of 0.49B parameters (head_dim 64; BPE tokenizer trained on the synthetic world)
#    in bf16 on DeepSpeed ZeRO-3 with gradient checkpointing: 2 SFT steps and 2 RL steps (rollouts with the
#    real local tools, SS-GRPO update, gathered weights synced into the engine's own copy): peak GPU memory,
#    SFT / update / rollout tokens/s, weight-sync seconds;
# 2b. full fine-tuning vs LoRA r=16 on that model (bench/lora.py): update tokens/s, peak GPU memory, checkpoint MiB;
# 2c. sample packing on that model (bench/packing.py --policy): packed vs padded logprobs (max difference), padding
#     and SFT tokens/s bucketed vs packed at a 16k-token budget, with SDPA and, where installed, flash-attention 2;
# 3. the memory plan for that model against the measured peak;
# 4. vLLM, where the image has it: bench/fleet_throughput.py (2 replicas, one push checked against a recompute,
#    fleet vs bare vLLM tokens/s, goal >= 0.8); else reported absent (its CUDA wheel is too large to carry).
# 5. scripts/gpu_learning_check.sh: the `learn` profile's SFT then 12 RL steps of `full`, held-out score before/after,
#    where the stack is there; else reported absent. On the lent image it runs in calls of its own, after
#    scripts/gpu_pack.py has carried Prefect, litellm, faiss and SmolLM2's weights (docs/gpu_check.md).
# 6. Ray, where the image has it: trainer ranks as Ray actors, one GPU each (Ray sets CUDA_VISIBLE_DEVICES), NCCL
#    among them, an all-reduce checked; else reported absent.
# GPU_CHECK_SIZE=tiny runs the same steps on a small model (a dry run on a CPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/* >/dev/null 2>&1; then
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --target /tmp/site .whl/* || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
PY=${PYTHON:-python3}
DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
$PY -c "import torch; print('gpu_check: device=' + (torch.cuda.get_device_name(0).replace(' ', '_') if torch.cuda.is_available() else 'cpu'))"

echo "== 1. device tests"
$PY -m pytest -q -p no:cacheprovider tests/test_devices.py 2>&1 | tail -3

echo "== 2. SFT + RL steps, ZeRO-3, gradient checkpointing"
POLICY=/tmp/gpu-check-policy
rm -rf "$POLICY"
$PY - "$POLICY" <<'PY'
import os, sys
from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy
from rubricem_core.scaffold import EXAMPLE_TRACE
from rubricem_core.sim.world import WorldConfig, generate_world

world = generate_world(WorldConfig(seed=0, n_documents=400, n_queries=8))
texts = [d.text for d in world.documents] + [q.question for q in world.queries] + [EXAMPLE_TRACE] * 4
if os.environ.get("GPU_CHECK_SIZE") == "tiny":
    spec = TinyPolicySpec(vocab_size=2048, hidden_size=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256)
else:  # 0.49B: 24 layers of width 1280 (20 heads of 64, 4 KV heads), MLP 3840, tied embeddings
    spec = TinyPolicySpec(vocab_size=8192, hidden_size=1280, n_layers=24, n_heads=20, n_kv_heads=4,
                          intermediate_size=3840, max_position_embeddings=8192)
print("policy:", build_tiny_policy(texts, sys.argv[1], spec))
PY
[ "${GPU_CHECK_SIZE:-}" = tiny ] && SHAPE=(--queries 2 --group 2 --max-new-tokens 64) \
    || SHAPE=(--queries 8 --group 8 --max-new-tokens 512 --max-total-tokens 4096)
DTYPE=(--dtype bfloat16 --precision bf16)
[ "$DEVICE" = cpu ] && DTYPE=(--dtype float32 --precision fp32)
$PY bench/rl_step_time.py --policy "$POLICY" --random-init --device "$DEVICE" "${DTYPE[@]}" "${SHAPE[@]}" \
    --backend deepspeed --zero-stage 3 --gradient-checkpointing --steps 2 --sft-steps 2 \
    --compare-recompute --peak-tflops "${GPU_PEAK_TFLOPS:-989}" 2>&1 \
    | grep -v -i "warn\|return func" | tee /tmp/gpu-check-rl.log \
    | sed -E 's/^(rollout_tokens_per_s|update_tokens_per_s|update_recompute_tokens_per_s|update_time_ratio|sft_tokens_per_s|weight_sync_s|peak_gpu_memory): /gpu_check: \1=/' \
    | sed -E 's/^(update_mfu|update_recompute_mfu): (.*)$/gpu_check: \1=\2 (goal >= 0.35)/'

echo "== 2b. full fine-tuning vs LoRA r=16 on this model: update tokens/s and peak GPU memory (issue #45)"
if $PY -c "import peft" 2>/dev/null; then
    [ "${GPU_CHECK_SIZE:-}" = tiny ] && LORA_SHAPE=(--tokens 256 --steps 1) || LORA_SHAPE=(--tokens 4096 --steps 3)
    LORA_DTYPE=bfloat16; [ "$DEVICE" = cpu ] && LORA_DTYPE=float32
    timeout 240 $PY bench/lora.py --policy "$POLICY" --device "$DEVICE" --dtype "$LORA_DTYPE" "${LORA_SHAPE[@]}" 2>&1 \
        | grep -v -i "warn" | sed -E 's/^lora_bench: /gpu_check: lora_vs_full: /'
    echo "gpu_check: lora_exit=${PIPESTATUS[0]}"
else
    echo "gpu_check: lora=absent (peft is not in this image)"
fi

echo "== 2c. sample packing on this model: logprobs packed vs padded, padding, tokens/s (issue #44)"
[ "${GPU_CHECK_SIZE:-}" = tiny ] && PACK_SHAPE=(--n-seqs 6 --lengths 64 300 --budget 1024 --steps 1) \
    || PACK_SHAPE=(--n-seqs 48 --lengths 256 4096 --budget 16384 --steps 2)
PACK_DTYPE=bfloat16; [ "$DEVICE" = cpu ] && PACK_DTYPE=float32
ATTNS=(sdpa); $PY -c "import flash_attn" 2>/dev/null && ATTNS+=(flash_attention_2)
for ATTN in "${ATTNS[@]}"; do
    timeout 180 $PY bench/packing.py --policy "$POLICY" --device "$DEVICE" --dtype "$PACK_DTYPE" --attn "$ATTN" \
        "${PACK_SHAPE[@]}" 2>&1 | grep -E "^(packing_|padding_|update_)" | sed -E "s/^/gpu_check: packing_$ATTN: /"
    echo "gpu_check: packing_${ATTN}_exit=${PIPESTATUS[0]}"
done

echo "== 3. the memory plan for this model (ZeRO-3 on 1 GPU, checkpointing, 16k-token micro-batches)"
$PY - "$POLICY" <<'PY'
import json, sys
from rubricem_core.distributed.memory import ModelShape, TrainSetup, memory_plan

shape = ModelShape.from_config(json.load(open(f"{sys.argv[1]}/config.json")))
plan = memory_plan(shape, TrainSetup(n_gpus=1, micro_batch_tokens=16384, seq_len=4096))
print(f"gpu_check: plan_params={shape.params}")
print("gpu_check: plan_gib=" + json.dumps({k: round(v / 2**30, 2) for k, v in plan.as_dict().items()}))
PY

echo "== 4. vLLM"
if $PY -c "import vllm" 2>/dev/null; then
    # 2 replicas of section 2's policy, one weight push into both (nccl where the trainer and each replica
    # have a GPU of their own; on one GPU gloo, as NCCL refuses two ranks of one group on one device),
    # checked against a recompute; rollout tokens/s through the fleet vs bare LLM.generate (~2 min on one H200)
    FLEET_SHAPE=(--policy "$POLICY" --prompts 128 --max-tokens 256 --eager)
    [ "${GPU_CHECK_SIZE:-}" = tiny ] && FLEET_SHAPE=(--quick)
    timeout 300 $PY bench/fleet_throughput.py "${FLEET_SHAPE[@]}" 2>&1 | grep -v -i "warn" \
        | tee /tmp/gpu-check-fleet.log \
        | sed -E 's/^figure: ([^ ]+=[^ ]*( [^ ]+)?)  goal: (.*)  met: (.*)$/gpu_check: \1 (goal \3, met: \4)/'
    echo "gpu_check: fleet_exit=${PIPESTATUS[0]}"
else
    echo "gpu_check: vllm=absent (not in this image; its CUDA wheel, 326 MB, is over the device tool's 64 MiB a call)"
fi

echo "== 5. does RL learn? the learn profile: SFT, then 12 RL steps of full, held-out score before/after (issue #43)"
timeout 330 bash scripts/gpu_learning_check.sh
echo "gpu_check: learning_exit=$?"

echo "== 6. Ray: trainer ranks as actors, one GPU each, NCCL among them (issue #30)"
if $PY -c "import ray" 2>/dev/null; then
    RAY_USAGE_STATS_ENABLED=0 timeout 180 $PY - <<'PY'
import time
from pathlib import Path

import ray

from rubricem_core.config import DistributedConfig
from rubricem_core.distributed.actors import RankGroup
from rubricem_core.distributed.cluster import connect

t = time.monotonic()
connect(DistributedConfig())
gpus = int(ray.cluster_resources().get("GPU", 0))
print(f"gpu_check: ray_start_s={time.monotonic() - t:.1f} ray_gpus={gpus}")
n = max(gpus, 1)
t = time.monotonic()
group = RankGroup("gpu-check", n, Path("/tmp/gpu-check-ranks"), timeout_s=120)
print(f"gpu_check: ray_group_start_s={time.monotonic() - t:.1f} ranks={n}")
seen = group.run("rubricem_core.distributed.actors:probe")
for s in seen:
    print(f"gpu_check: ray_rank={s['rank']} backend={s['backend']} device={s['device'].replace(' ', '_')} "
          f"visible={s['cuda_visible_devices']} all_reduce={s['all_reduce']:.0f} (expected {n * (n + 1) // 2})")
group.close()
PY
    echo "gpu_check: ray_exit=$?"
else
    echo "gpu_check: ray=absent (not in this image; its wheel, 285 MB, is over the device tool's 64 MiB a call)"
fi
