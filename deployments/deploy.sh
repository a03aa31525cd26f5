#!/usr/bin/env bash
# Register every deployment of prefect.yaml against the server at PREFECT_API_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUBRICEM_HOME="$PWD"
bash deployments/create_pool.sh
prefect --no-prompt deploy --all
