#!/usr/bin/env bash
# Create (or update) the Kubernetes work pool `rubricem-gpu` from base-job-template.json.
# Rerunning replaces the pool's template, so edits to the JSON take effect.
set -euo pipefail
source "$(dirname "$0")/../_env.sh"
require_api_url
prefect work-pool create rubricem-gpu --type kubernetes \
  --base-job-template deployments/gpu/base-job-template.json --overwrite
