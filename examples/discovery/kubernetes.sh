#!/usr/bin/env bash
# Discovery recipe: the running pods of a Kubernetes label selector.
#
#   SELECTOR=app=trainer NAMESPACE=ml SLOTS=1 elasticrun -np 4 --min-np 2 \
#       --host-discovery-script examples/discovery/kubernetes.sh python train.py
#
# Prints the pod IP of every pod matching $SELECTOR (required) in $NAMESPACE (default: the
# current context's) that is Running and not being deleted, as `IP:$SLOTS` (default 1).
# Set HOST_FIELD=name to print pod names instead (they must resolve, e.g. through a headless
# Service). The pods must run sshd and the same Python environment (docs/ssh.md).
# kubectl gets $KUBECTL_TIMEOUT (default 5s) so the script ends within elasticrun's
# --discovery-timeout (default 10 s); kubectl failing is a failed run (exit 1).
# Contract: docs/discovery.md.
set -euo pipefail
me=kubernetes.sh
kubectl=${KUBECTL:-kubectl}   # or the tool's full path

if ! command -v "$kubectl" >/dev/null 2>&1; then
    echo "$me: kubectl not found (\"$kubectl\" is not on PATH; install it or set KUBECTL to its path)" >&2
    exit 1
fi
if [[ -z "${SELECTOR:-}" ]]; then
    echo "$me: set SELECTOR to the label selector of the training pods, e.g. SELECTOR=app=trainer" >&2
    exit 1
fi
slots=${SLOTS:-1}
if ! [[ "$slots" =~ ^[1-9][0-9]*$ ]]; then
    echo "$me: SLOTS='$slots' is not a positive whole number" >&2
    exit 1
fi
case ${HOST_FIELD:-ip} in
    ip) field='{.status.podIP}' ;;
    name) field='{.metadata.name}' ;;
    *) echo "$me: HOST_FIELD must be ip or name, not '${HOST_FIELD}'" >&2; exit 1 ;;
esac
args=(get pods -l "$SELECTOR" --request-timeout="${KUBECTL_TIMEOUT:-5s}"
      -o "jsonpath={range .items[*]}$field{\" \"}{.status.phase}{\" \"}{.metadata.deletionTimestamp}{\"\\n\"}{end}")
if [[ -n "${NAMESPACE:-}" ]]; then
    args+=(-n "$NAMESPACE")
fi
if ! out=$("$kubectl" "${args[@]}"); then
    echo "$me: kubectl get pods -l $SELECTOR failed (see above)" >&2
    exit 1
fi
# Columns: host, phase, deletion timestamp (empty unless terminating).
awk -v slots="$slots" '$1 != "" && $2 == "Running" && $3 == "" { print $1 ":" slots }' <<<"$out"
