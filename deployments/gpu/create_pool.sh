#!/usr/bin/env bash
# Create (or update) the Kubernetes work pools `rubricem-gpu` (one pod per flow run, base-job-template.json)
# and `rubricem-gpu-multinode` (an Indexed Job of N pods, base-job-template-multinode.json).
# Rerunning replaces the pool's template, so edits to the JSON take effect.
set -euo pipefail
source "$(dirname "$0")/../_env.sh"
require_api_url
prefect work-pool create rubricem-gpu --type kubernetes \
  --base-job-template deployments/gpu/base-job-template.json --overwrite
# Several nodes per flow run: an Indexed Job of `nodes` pods (pod 0 runs the flow run, the others
# `rubricem ranks`); their DNS names come from the headless Service in headless-service.yaml.
prefect work-pool create rubricem-gpu-multinode --type kubernetes \
  --base-job-template deployments/gpu/base-job-template-multinode.json --overwrite
