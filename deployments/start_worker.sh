#!/usr/bin/env bash
# Start a worker for the RubricEM pool from the repository root (the flows run from this checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
export RUBRICEM_HOME="$PWD"
exec prefect worker start --pool "${RUBRICEM_POOL:-rubricem-process}"
