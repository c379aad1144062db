#!/usr/bin/env bash
# Smoke test of the Kubernetes manifests on kind (CPU only), for a machine with Docker and kind:
#
#   build the CPU image -> kind cluster (1 control plane + 2 workers, k8s/kind/cluster.yaml) -> load the
#   image -> token Secret -> the kind overlay (k8s/overlays/kind-cpu) -> `ray job submit` a short run
#   (2 workers, 60 steps, a snapshot every 10) -> delete one worker pod at step >= 20 -> the job resumes
#   from its newest snapshot and finishes -> scripts/smoke_assert.py checks the run directory
#   (copied out of the head pod) -> the cluster is deleted, also on failure or Ctrl-C.
#
# Usage: scripts/kind-smoke.sh            (or `make kind-smoke`)
# Environment:
#   KIND_CLUSTER=trainapp-smoke  cluster name; an existing cluster of that name is an error (never reused)
#   KEEP_CLUSTER=1               keep the cluster afterwards, for debugging (delete: kind delete cluster --name ...)
#   SKIP_BUILD=1                 use the existing trainapp:0.1.0-cpu image instead of `make image-cpu`
#   LOCAL_PORT=28265             local end of the port-forward to the dashboard
#   RAY=path/to/ray              Ray CLI for `ray job` (default: .venv/bin/ray, else `ray` on PATH)
#   TIMEOUT=900                  seconds for the whole job (build and cluster creation not counted)
# Needs: docker, kind, kubectl, make, python3 (smoke_assert.py is standard-library only), the Ray CLI
# (ray 2.60.0: `make venv`). It never touches another kubectl context: every call names kind-$KIND_CLUSTER.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER="${KIND_CLUSTER:-trainapp-smoke}"
CONTEXT="kind-${CLUSTER}"
NS=trainapp
IMAGE=trainapp:0.1.0-cpu
# Must match the extraMounts hostPath of k8s/kind/cluster.yaml.
RUNS_HOST_DIR=/tmp/trainapp-kind-runs
LOCAL_PORT="${LOCAL_PORT:-28265}"
TIMEOUT="${TIMEOUT:-900}"
NAME="smoke-$(date +%Y%m%d-%H%M%S)"
STEPS=60
EVERY=10
KILL_AT=20
if [[ -z "${RAY:-}" ]]; then
    if [[ -x "${REPO}/.venv/bin/ray" ]]; then RAY="${REPO}/.venv/bin/ray"; else RAY=ray; fi
fi

T0=$(date +%s)
CREATED=0
PF_PID=
RESULT="FAIL"
DETAIL=
STAGE="starting"

log() { STAGE="$*"; printf 'kind-smoke [%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
die() { DETAIL="$*"; log "error: $*"; exit 1; }
k() { kubectl --context "${CONTEXT}" -n "${NS}" "$@"; }
ray_job() { "${RAY}" job "$1" --address "http://127.0.0.1:${LOCAL_PORT}" "${@:2}"; }

cleanup() {
    local rc=$?
    if [[ "${rc}" -ne 0 && -z "${DETAIL}" ]]; then DETAIL="failed (exit ${rc}) during: ${STAGE}"; fi
    if [[ "${rc}" -ne 0 && "${CREATED}" -eq 1 ]]; then
        echo "kind-smoke: diagnostics"
        k get pods -o wide 2>&1 | sed 's/^/  /' || true
        if [[ -n "${PF_PID}" ]]; then ray_job logs "${NAME}" 2>&1 | tail -n 40 | sed 's/^/  job: /' || true; fi
    fi
    if [[ -n "${PF_PID}" ]]; then
        kill "${PF_PID}" 2>/dev/null || true
        wait "${PF_PID}" 2>/dev/null || true
    fi
    if [[ "${CREATED}" -eq 1 ]]; then
        # The run's files belong to uid 1000 in the pods: delete them from inside, before the cluster.
        k exec deploy/ray-head -- rm -rf "/mnt/runs/${NAME}" >/dev/null 2>&1 || true
        if [[ "${KEEP_CLUSTER:-0}" == 1 ]]; then
            log "keeping cluster ${CLUSTER} (KEEP_CLUSTER=1); delete it with: kind delete cluster --name ${CLUSTER}"
        else
            log "deleting kind cluster ${CLUSTER}"
            kind delete cluster --name "${CLUSTER}" >/dev/null 2>&1 || true
        fi
    fi
    if [[ "${rc}" -eq 0 ]]; then RESULT="PASS"; fi
    echo "kind-smoke: ${RESULT} in $(($(date +%s) - T0))s: ${DETAIL}"
    exit "${rc}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The run's metrics.jsonl, read in the head pod (nothing while it does not exist yet).
metrics() { k exec deploy/ray-head -- cat "/mnt/runs/${NAME}/metrics.jsonl" 2>/dev/null || true; }

# "MAX_TRAIN_STEP RESUMED_STEP" of the run (RESUMED_STEP is - until it has resumed from a snapshot).
progress() { metrics | python3 "${REPO}/scripts/smoke_assert.py" - --progress; }
max_step() { progress | cut -d' ' -f1; }
resumed_step() { progress | cut -d' ' -f2 | grep -v '^-$' || true; }

# (Re)start the port-forward to the dashboard: it ends when its connection breaks.
port_forward() {
    if [[ -n "${PF_PID}" ]] && kill -0 "${PF_PID}" 2>/dev/null; then return; fi
    kubectl --context "${CONTEXT}" -n "${NS}" port-forward svc/ray-head "${LOCAL_PORT}:8265" >/dev/null 2>&1 &
    PF_PID=$!
    sleep 1
}

# `ray job status` prints "Job 'X' succeeded" / "failed" / "was stopped" / "is running" (no enum names).
job_status() {
    port_forward
    ray_job status "${NAME}" 2>/dev/null | grep -oiE 'pending|running|succeeded|failed|stopped' | tail -n 1 \
        | tr '[:lower:]' '[:upper:]' || true
}

# Fail the wait loops early when the job has ended badly.
check_job_alive() {
    local status
    status="$(job_status)"
    case "${status}" in
        FAILED | STOPPED) die "job ${NAME} is ${status} (see the job log above)" ;;
    esac
}

# -------------------------------------------------------------------------------------------------
for tool in docker kind kubectl make python3; do
    command -v "${tool}" >/dev/null || die "${tool} not found on PATH"
done
command -v "${RAY}" >/dev/null || die "Ray CLI ${RAY} not found (make venv, or set RAY=...)"
if kind get clusters 2>/dev/null | grep -qx "${CLUSTER}"; then
    die "a kind cluster named ${CLUSTER} exists already; delete it or set KIND_CLUSTER"
fi

if [[ "${SKIP_BUILD:-0}" == 1 ]]; then
    log "building: skipped (SKIP_BUILD=1), using ${IMAGE}"
else
    log "building ${IMAGE} (make image-cpu)"
    make -C "${REPO}" image-cpu
fi
docker image inspect "${IMAGE}" >/dev/null 2>&1 || die "image ${IMAGE} not found after the build"

log "starting kind cluster ${CLUSTER} (1 control plane + 2 workers)"
# The shared run directory every node mounts; pods write it as uid 1000.
mkdir -p "${RUNS_HOST_DIR}"
chmod 0777 "${RUNS_HOST_DIR}"
CREATED=1
kind create cluster --name "${CLUSTER}" --config "${REPO}/k8s/kind/cluster.yaml" --wait 180s
kind load docker-image "${IMAGE}" --name "${CLUSTER}"

log "starting Ray: token Secret, then the kind overlay"
kubectl --context "${CONTEXT}" apply -f "${REPO}/k8s/00-namespace.trainapp.yaml"
TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
k create secret generic ray-auth-token --from-literal=token="${TOKEN}" >/dev/null
kubectl kustomize --load-restrictor=LoadRestrictionsNone "${REPO}/k8s/overlays/kind-cpu" \
    | kubectl --context "${CONTEXT}" apply -f -
k wait --for=condition=Available deployment --all --timeout=300s
k wait --for=condition=Ready pod -l app.kubernetes.io/name=trainapp --timeout=300s

port_forward
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN="${TOKEN}"
# The dashboard answers some seconds before its job agent accepts jobs: wait for `ray job list`.
for _ in $(seq 1 60); do
    if ray_job list >/dev/null 2>&1; then break; fi
    sleep 2
    port_forward
done
ray_job list >/dev/null 2>&1 || die "the Ray dashboard accepts no requests through the port-forward"

ray_job submit --submission-id "${NAME}" --no-wait -- \
    python -m trainapp ray --config /etc/trainapp/config.yaml \
    ray.name="${NAME}" ray.storage_path=/mnt/runs ray.num_workers=2 ray.max_failures=3 \
    ray.worker_group_start_timeout_s=120 \
    train.max_steps="${STEPS}" train.epochs=20 train.log_every=1 snapshot.every_steps="${EVERY}" \
    data.train_size=2048 data.val_size=256 >/dev/null
log "submitted job ${NAME}: 2 workers, ${STEPS} steps, a snapshot every ${EVERY}"

deadline=$(($(date +%s) + TIMEOUT))
step=0
while ((step < KILL_AT)); do
    (($(date +%s) < deadline)) || die "the run never reached step ${KILL_AT} (at ${step})"
    check_job_alive
    sleep 2
    step="$(max_step)"
done
victim="$(k get pod -l app.kubernetes.io/component=ray-worker -o jsonpath='{.items[0].metadata.name}')"
k delete pod "${victim}" --wait=false >/dev/null
log "killed worker pod ${victim} at step ${step}"

resumed=
while [[ -z "${resumed}" ]]; do
    (($(date +%s) < deadline)) || die "the run never restarted after ${victim} was deleted"
    check_job_alive
    sleep 3
    resumed="$(resumed_step)"
done
log "resumed from step ${resumed} (killed at ${step}); waiting for the job to finish"

status=
until [[ "${status}" == SUCCEEDED ]]; do
    (($(date +%s) < deadline)) || die "job ${NAME} did not finish within ${TIMEOUT}s (status ${status:-unknown})"
    check_job_alive
    sleep 5
    status="$(job_status)"
done
log "job ${NAME} succeeded; checking the run directory"

python3 "${REPO}/scripts/smoke_assert.py" "/mnt/runs/${NAME}" --backend kind --context "${CONTEXT}" \
    --namespace "${NS}" --container ray-head --expect-steps "${STEPS}" \
    --nonroot-selector app.kubernetes.io/name=trainapp \
    || die "smoke_assert.py found a problem in /mnt/runs/${NAME}"
log "passed"
DETAIL="worker pod killed at step ${step}, resumed from step ${resumed}, ${STEPS}/${STEPS} steps"
