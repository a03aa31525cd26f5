#!/usr/bin/env bash
# Start a worker for the process pool. Flow runs are child processes of the worker that run from this
# checkout (RUBRICEM_HOME, exported by _env.sh, is what prefect.yaml's pull step changes into), so
# relative run_dir parameters land under this checkout's runs/. Extra arguments go to the worker,
# e.g. --limit 1 to run one flow at a time.
set -euo pipefail
source "$(dirname "$0")/_env.sh"
require_api_url
exec prefect worker start --pool "$POOL" --type process "$@"
