#!/usr/bin/env bash
# Apply the RayCluster (raycluster.yaml, with its image set to $RUBRICEM_IMAGE) and its NetworkPolicy
# (networkpolicy.yaml) in the namespace `rubricem`. Rerunning updates them in place. Prerequisites (once):
# the KubeRay operator, the Secrets rubricem-ray-token (auth_token), rubricem-prefect (PREFECT_API_URL,
# PREFECT_API_AUTH_STRING) and
# rubricem-api-keys (OPENAI_API_KEY), and the claims rubricem-runs (ReadWriteMany) and rubricem-hf-cache.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if [ -z "${RUBRICEM_IMAGE:-}" ]; then
  echo "set RUBRICEM_IMAGE to the image built from deployments/gpu/Dockerfile" >&2
  exit 2
fi
if ! kubectl -n rubricem get secret rubricem-ray-token >/dev/null 2>&1; then
  echo "no Secret rubricem-ray-token: create it first (every Ray process authenticates with its token):" >&2
  echo "  kubectl -n rubricem create secret generic rubricem-ray-token --from-literal=auth_token=\"\$(openssl rand -hex 32)\"" >&2
  exit 2
fi
kubectl -n rubricem apply -f networkpolicy.yaml  # first: the Ray pods never run without it
sed "s|image: rubricem:gpu|image: ${RUBRICEM_IMAGE}|" raycluster.yaml | kubectl -n rubricem apply -f -
echo "RayCluster rubricem applied; wait for it: kubectl -n rubricem get raycluster rubricem -w" >&2
