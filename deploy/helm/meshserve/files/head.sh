#!/bin/bash
# meshserve head pod: start the Ray head daemons, then run `meshserve serve` in the foreground.
# Every setting arrives as environment from the chart's ConfigMap and the pod spec; an empty
# optional variable leaves its flag out so that the server's own default applies.
# Every variable not set here comes from the pod environment (ConfigMap envFrom and env).
# shellcheck disable=SC2154
set -euo pipefail
ulimit -n 65536 2>/dev/null || true

if [[ -n "${KUBERAY_GEN_RAY_START_CMD:-}" ]]; then
  # KubeRay mode: the operator built `ray start --head ...` from rayStartParams. It ends in
  # --block; dropping that lets the daemons detach so the gRPC server is the main process.
  eval "${KUBERAY_GEN_RAY_START_CMD//--block/}"
else
  dashboard=(--include-dashboard=false)
  if [[ "${RAY_DASHBOARD}" == "true" ]]; then
    dashboard=(--include-dashboard=true --dashboard-host=0.0.0.0)
  fi
  ray start --head \
    --node-ip-address="${POD_IP}" \
    --port="${RAY_PORT}" \
    --node-manager-port="${RAY_NODE_MANAGER_PORT}" \
    --object-manager-port="${RAY_OBJECT_MANAGER_PORT}" \
    --num-cpus="${RAY_NUM_CPUS}" \
    --num-gpus=0 \
    "${dashboard[@]}" \
    --disable-usage-stats
fi

# --host/--port: the OpenAI-compatible HTTP API (as vLLM's); gRPC on --grpc-host/--grpc-port; the
# Service scrapes metrics on a port of their own (/metrics is on the API port too).
args=(serve
  --grpc-host 0.0.0.0
  --grpc-port "${MESHSERVE_GRPC_PORT}"
  --metrics-port "${MESHSERVE_METRICS_PORT}"
  --metrics-host 0.0.0.0)
if [[ "${MESHSERVE_HTTP_PORT}" == "0" ]]; then
  args+=(--no-http)
else
  args+=(--host 0.0.0.0 --port "${MESHSERVE_HTTP_PORT}")
fi
args+=(
  --ray-address "${POD_IP}:${RAY_PORT}"
  --dtype "${MESHSERVE_DTYPE}"
  --tp "${MESHSERVE_TP}"
  --dcp "${MESHSERVE_DCP}"
  --ep "${MESHSERVE_EP}"
  --pools "${MESHSERVE_POOLS}")

# optional FLAG VALUE: add the flag only when the value is set.
optional() {
  if [[ -n "$2" ]]; then args+=("$1" "$2"); fi
}
if [[ "${MESHSERVE_POOLS}" == "unified" ]]; then
  args+=(--replicas "${MESHSERVE_REPLICAS}")
else
  args+=(--prefill-replicas "${MESHSERVE_PREFILL_REPLICAS}" --decode-replicas "${MESHSERVE_DECODE_REPLICAS}")
  # a pool's own layout; unset: --tp/--dcp
  optional --prefill-tp "${MESHSERVE_PREFILL_TP:-}"
  optional --prefill-dcp "${MESHSERVE_PREFILL_DCP:-}"
  optional --decode-tp "${MESHSERVE_DECODE_TP:-}"
  optional --decode-dcp "${MESHSERVE_DECODE_DCP:-}"
  optional --kv-transport "${MESHSERVE_KV_TRANSPORT:-}"
  if [[ "${MESHSERVE_KV_VERIFY_CHECKSUM:-false}" == "true" ]]; then args+=(--kv-verify-checksum); fi
fi
optional --model "${MESHSERVE_MODEL:-}"
optional --attention-backend "${MESHSERVE_ATTENTION_BACKEND:-}"
optional --block-size "${MESHSERVE_BLOCK_SIZE:-}"
optional --max-model-len "${MESHSERVE_MAX_MODEL_LEN:-}"
optional --max-queue "${MESHSERVE_MAX_QUEUE:-}"
optional --api-server-count "${MESHSERVE_API_SERVER_COUNT:-}"
optional --tls-cert "${MESHSERVE_TLS_CERT:-}"
optional --tls-key "${MESHSERVE_TLS_KEY:-}"
optional --auth-token-file "${MESHSERVE_AUTH_TOKEN_FILE:-}"
optional --metrics-token-file "${MESHSERVE_METRICS_TOKEN_FILE:-}"
optional --placement-timeout "${MESHSERVE_PLACEMENT_TIMEOUT:-}"
optional --unhealthy-liveness-seconds "${MESHSERVE_UNHEALTHY_LIVENESS_SECONDS:-}"
optional --step-timeout-base "${MESHSERVE_STEP_TIMEOUT_BASE:-}"
optional --step-timeout-per-token "${MESHSERVE_STEP_TIMEOUT_PER_TOKEN:-}"
optional --max-migrations "${MESHSERVE_MAX_MIGRATIONS:-}"
if [[ -n "${MESHSERVE_EXTRA_ARGS:-}" ]]; then
  read -r -a extra <<< "${MESHSERVE_EXTRA_ARGS}"
  args+=("${extra[@]}")
fi

echo "meshserve head: meshserve ${args[*]}" >&2
exec meshserve "${args[@]}"
