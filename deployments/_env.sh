# Sourced by the scripts in deployments/: run from the repository root, with the project's venv first
# on PATH (so `prefect` and the flow-run processes a worker starts use the project's interpreter).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export RUBRICEM_HOME="$PWD"   # prefect.yaml's pull step runs the flows from this checkout
if [ -x .venv/bin/prefect ]; then
  export PATH="$PWD/.venv/bin:$PATH"
fi
POOL=rubricem-process         # the work pool prefect.yaml's deployments target

# Without an API URL every prefect command would talk to a throwaway ephemeral server: refuse.
require_api_url() {
  local url="${PREFECT_API_URL:-}"
  if [ -z "$url" ]; then  # not exported: maybe set in the active Prefect profile
    url="$(python -c 'from prefect.settings import PREFECT_API_URL; print(PREFECT_API_URL.value() or "")')"
  fi
  if [ -z "$url" ]; then
    echo "PREFECT_API_URL is not set. Start a server (prefect server start) and" \
         "export PREFECT_API_URL=http://127.0.0.1:4200/api (or 'prefect config set PREFECT_API_URL=...')." >&2
    exit 2
  fi
  echo "Prefect API: $url" >&2
}
