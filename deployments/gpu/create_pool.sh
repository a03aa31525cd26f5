#!/usr/bin/env bash
# Create (or update) the work pools of prefect-gpu.yaml:
#   rubricem-gpu  Kubernetes: one pod per flow run (base-job-template.json); a flow run that trains on
#                 several GPUs starts a local Ray inside its pod. Rerunning replaces the pool's template.
#   rubricem-ray  process: its worker runs in the head pod of the RayCluster (raycluster.yaml), so each
#                 flow run is a Ray driver on the head node. Idempotent: an existing pool is kept.
set -euo pipefail
source "$(dirname "$0")/../_env.sh"
require_api_url
prefect work-pool create rubricem-gpu --type kubernetes \
  --base-job-template deployments/gpu/base-job-template.json --overwrite
if prefect work-pool inspect rubricem-ray >/dev/null 2>&1; then
  echo "work pool 'rubricem-ray' exists"
elif ! prefect work-pool create rubricem-ray --type process; then
  # the worker in the head pod creates the pool itself when it starts first
  prefect work-pool inspect rubricem-ray >/dev/null
  echo "work pool 'rubricem-ray' exists"
fi
