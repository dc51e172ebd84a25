#!/usr/bin/env bash
# Discovery recipe: the running pods of a Kubernetes label selector, and which of them are
# about to go away.
#
#   SELECTOR=app=trainer NAMESPACE=ml SLOTS=1 elasticrun -np 4 --min-np 2 \
#       --host-discovery-script examples/discovery/kubernetes.sh python train.py
#
# Prints the pod IP of every pod matching $SELECTOR (required) in $NAMESPACE (default: the
# current context's) that is Running, as `IP:$SLOTS` (default 1). Set HOST_FIELD=name to
# print pod names instead (they must resolve, e.g. through a headless Service). The pods must
# run sshd and the same Python environment (docs/ssh.md).
#
# A pod that is about to go away is printed as `IP:$SLOTS draining  # why`: its workers leave
# gracefully at the next step and nothing new starts there. That is a pod being deleted
# (metadata.deletionTimestamp set: give it a terminationGracePeriodSeconds long enough for a
# step), or a pod on a node that is cordoned (spec.unschedulable), being deleted, or tainted
# with one of $DRAIN_TAINTS (space separated keys, NoSchedule or NoExecute) whose default is
# the taints of a node on its way out:
#   node.kubernetes.io/unschedulable node.kubernetes.io/not-ready node.kubernetes.io/unreachable
#   node.kubernetes.io/out-of-service node.cloudprovider.kubernetes.io/shutdown
#   ToBeDeletedByClusterAutoscaler cloud.google.com/impending-node-termination
#   aws-node-termination-handler/spot-itn aws-node-termination-handler/rebalance-recommendation
#   aws-node-termination-handler/scheduled-maintenance
#   aws-node-termination-handler/asg-lifecycle-termination karpenter.sh/disrupted
#   karpenter.sh/disruption
# (not every NoSchedule taint: a GPU node's nvidia.com/gpu taint, say, is there for good).
# Reading nodes needs `list nodes` at cluster scope (a ClusterRole); $NODE_SELECTOR (a label
# selector) limits which nodes are read on a big cluster. NOTICES=0 reads no nodes (pods
# being deleted are still marked). The JSON is read with $PYTHON (default python3).
#
# kubectl gets $KUBECTL_TIMEOUT (default 5s) per call so the script ends within elasticrun's
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
    ip|name) ;;
    *) echo "$me: HOST_FIELD must be ip or name, not '${HOST_FIELD}'" >&2; exit 1 ;;
esac
python=${PYTHON:-python3}
if ! command -v "$python" >/dev/null 2>&1; then
    echo "$me: $python not found (it reads kubectl's JSON; set PYTHON to a Python 3)" >&2
    exit 1
fi
timeout_arg=--request-timeout="${KUBECTL_TIMEOUT:-5s}"

args=(get pods -l "$SELECTOR" "$timeout_arg" -o json)
if [[ -n "${NAMESPACE:-}" ]]; then
    args+=(-n "$NAMESPACE")
fi
if ! pods=$("$kubectl" "${args[@]}"); then
    echo "$me: kubectl get pods -l $SELECTOR failed (see above)" >&2
    exit 1
fi
nodes='{"items": []}'
if [[ "${NOTICES:-1}" != 0 ]]; then
    args=(get nodes "$timeout_arg" -o json)
    if [[ -n "${NODE_SELECTOR:-}" ]]; then
        args+=(-l "$NODE_SELECTOR")
    fi
    if ! nodes=$("$kubectl" "${args[@]}"); then
        echo "$me: kubectl get nodes failed (see above); it needs list on nodes (a ClusterRole), or set NOTICES=0 to skip node notices" >&2
        exit 1
    fi
fi

default_taints="node.kubernetes.io/unschedulable node.kubernetes.io/not-ready
    node.kubernetes.io/unreachable node.kubernetes.io/out-of-service
    node.cloudprovider.kubernetes.io/shutdown ToBeDeletedByClusterAutoscaler
    cloud.google.com/impending-node-termination aws-node-termination-handler/spot-itn
    aws-node-termination-handler/rebalance-recommendation
    aws-node-termination-handler/scheduled-maintenance
    aws-node-termination-handler/asg-lifecycle-termination karpenter.sh/disrupted
    karpenter.sh/disruption"
# Pods on fd 3, nodes on fd 4 (here-strings: no size limit, unlike arguments or variables).
program=$(cat <<'PY'
import json, os, sys

slots, field, taints = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
try:
    with open(3) as f:
        pods = json.load(f)["items"]
    with open(4) as f:
        nodes = json.load(f)["items"]
except (ValueError, KeyError, TypeError) as exc:
    sys.exit(f"kubernetes.sh: kubectl printed no JSON list ({exc})")

leaving = {}  # node name -> why it is going away
for node in nodes:
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    why = []
    if spec.get("unschedulable"):
        why.append("cordoned")
    if meta.get("deletionTimestamp"):
        why.append("being deleted")
    for taint in spec.get("taints") or []:
        if taint.get("key") in taints and taint.get("effect") in ("NoSchedule", "NoExecute"):
            why.append(f"taint {taint['key']}:{taint['effect']}")
    if why:
        leaving[meta.get("name")] = ", ".join(why)

for pod in pods:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    host = status.get("podIP") if field == "ip" else meta.get("name")
    if status.get("phase") != "Running" or not host:
        continue
    why = []
    if meta.get("deletionTimestamp"):
        why.append(f"pod {meta.get('name')} deleted at {meta['deletionTimestamp']}")
    if spec.get("nodeName") in leaving:
        why.append(f"node {spec['nodeName']} {leaving[spec['nodeName']]}")
    print(f"{host}:{slots}" + (f" draining  # {'; '.join(why)}" if why else ""))
PY
)
"$python" -c "$program" "$slots" "${HOST_FIELD:-ip}" "${DRAIN_TAINTS:-$default_taints}" 3<<<"$pods" 4<<<"$nodes"
