#!/usr/bin/env bash
# Register the deployments of prefect.yaml with the server at PREFECT_API_URL (creating the work pool
# first). Idempotent: deploying again updates the deployments in place.
#   bash deployments/deploy.sh                      # every deployment
#   bash deployments/deploy.sh collect-sft-data sft # only these
set -euo pipefail
source "$(dirname "$0")/_env.sh"
bash deployments/create_pool.sh
args=(--all)
if [ "$#" -gt 0 ]; then
  args=()
  for name in "$@"; do args+=(--name "$name"); done
fi
prefect --no-prompt deploy "${args[@]}"
