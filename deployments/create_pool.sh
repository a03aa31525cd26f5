#!/usr/bin/env bash
# Create the process work pool the deployments in prefect.yaml target (idempotent).
set -euo pipefail
POOL="${RUBRICEM_POOL:-rubricem-process}"
prefect work-pool inspect "$POOL" >/dev/null 2>&1 || prefect work-pool create "$POOL" --type process
