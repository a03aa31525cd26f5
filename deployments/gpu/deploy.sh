#!/usr/bin/env bash
# Register deployments/gpu/prefect-gpu.yaml (creating/updating the pools first). The image must exist in
# a registry the cluster can pull from: RUBRICEM_IMAGE=registry.example.com/rubricem:gpu.
#   bash deployments/gpu/deploy.sh                 # every GPU deployment
#   bash deployments/gpu/deploy.sh sft-gpu rl-gpu  # only these
set -euo pipefail
source "$(dirname "$0")/../_env.sh"
if [ -z "${RUBRICEM_IMAGE:-}" ]; then
  echo "set RUBRICEM_IMAGE to the image built from deployments/gpu/Dockerfile" >&2
  exit 2
fi
bash deployments/gpu/create_pool.sh
args=(--all)
if [ "$#" -gt 0 ]; then
  args=()
  for name in "$@"; do args+=(--name "$name"); done
fi
prefect --no-prompt deploy --prefect-file deployments/gpu/prefect-gpu.yaml "${args[@]}"
