#!/usr/bin/env bash
# Create the process work pool the deployments in prefect.yaml target. Idempotent: an existing pool
# (and any settings changed on it in the UI) is left as it is.
set -euo pipefail
source "$(dirname "$0")/_env.sh"
require_api_url
if prefect work-pool inspect "$POOL" >/dev/null 2>&1; then
  echo "work pool '$POOL' exists"
elif ! prefect work-pool create "$POOL" --type process; then
  # a worker started meanwhile creates the pool itself; only a pool that still does not exist is an error
  prefect work-pool inspect "$POOL" >/dev/null
  echo "work pool '$POOL' exists"
fi
