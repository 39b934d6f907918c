#!/bin/bash
# meshserve worker pod: wait for the Ray head, then join it as a Ray node that advertises
# MESHSERVE_POOL_SLOTS units of the resource "meshserve_<pool>" (one per rank it can host),
# which is how the coordinator places prefill, decode or unified replicas on this pod.
# Every variable not set here comes from the pod environment (ConfigMap envFrom and env).
# shellcheck disable=SC2154
set -euo pipefail
ulimit -n 65536 2>/dev/null || true

if [[ -n "${KUBERAY_GEN_RAY_START_CMD:-}" ]]; then
  # KubeRay mode: the operator waits for the head and built `ray start ... --block`.
  eval "exec ${KUBERAY_GEN_RAY_START_CMD}"
fi

# The head's Service publishes not-ready addresses, so this waits only for DNS and the GCS port.
until python3 -c 'import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2).close()' \
    "${RAY_HEAD_HOST}" "${RAY_PORT}" 2>/dev/null; do
  echo "meshserve worker: waiting for the Ray head at ${RAY_HEAD_HOST}:${RAY_PORT}" >&2
  sleep "${MESHSERVE_WAIT_SECONDS:-2}"
done

exec ray start \
  --address="${RAY_HEAD_HOST}:${RAY_PORT}" \
  --node-ip-address="${POD_IP}" \
  --node-manager-port="${RAY_NODE_MANAGER_PORT}" \
  --object-manager-port="${RAY_OBJECT_MANAGER_PORT}" \
  --num-cpus="${RAY_NUM_CPUS}" \
  --num-gpus="${RAY_NUM_GPUS}" \
  --resources="{\"meshserve_${MESHSERVE_POOL}\": ${MESHSERVE_POOL_SLOTS}}" \
  --disable-usage-stats \
  --block
