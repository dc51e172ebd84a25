#!/usr/bin/env bash
# Discovery recipe: the nodes of the current Slurm allocation, and which of them are being
# drained.
#
# Run elasticrun inside the allocation (sbatch/salloc), e.g.:
#   elasticrun -np 8 --min-np 4 --host-discovery-script examples/discovery/slurm.sh python train.py
#
# Slots per node: $SLOTS, else the leading number of $SLURM_NTASKS_PER_NODE, else
# $SLURM_GPUS_ON_NODE, else 1. A node whose name is listed in $EXCLUDE_FILE (one per line,
# optional) is left out: write a node there to drain it from the job by hand.
#
# A node that an administrator or a health check is draining (`scontrol show node` says
# State=...+DRAIN, e.g. MIXED+DRAIN or IDLE+DRAIN, which sinfo shows as drng and drain), or
# that is failing (+FAIL), is printed as `node:slots draining  # state: reason`: its workers
# leave gracefully at the next step and nothing new starts there, so the drain can complete.
# The node stays in the job's allocation until the job ends or is resized
# (`scontrol update JobId=$SLURM_JOB_ID NumNodes=...`). `scontrol show node` asks slurmctld:
# if it cannot be reached the run fails (elasticrun keeps the last hosts); NOTICES=0 skips it.
# Elastic growth on Slurm means a job whose node list changes (e.g. heterogeneous or
# `scontrol update` resized jobs); with a fixed allocation this still gives fault tolerance.
# Contract: docs/discovery.md.
set -euo pipefail
me=slurm.sh
scontrol=${SCONTROL:-scontrol}   # or the tool's full path

if ! command -v "$scontrol" >/dev/null 2>&1; then
    echo "$me: scontrol not found (\"$scontrol\" is not on PATH; set SCONTROL to its path): run elasticrun on a Slurm node (inside sbatch/salloc)" >&2
    exit 1
fi
if [[ -z "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" ]]; then
    echo "$me: SLURM_JOB_NODELIST is not set: run elasticrun inside a Slurm allocation (sbatch/salloc)" >&2
    exit 1
fi
nodelist=${SLURM_JOB_NODELIST:-$SLURM_NODELIST}

slots=${SLOTS:-}
if [[ -z "$slots" && -n "${SLURM_NTASKS_PER_NODE:-}" ]]; then
    slots=${SLURM_NTASKS_PER_NODE%%[!0-9]*}   # "4(x2)" -> 4
fi
if [[ -z "$slots" && -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
    slots=$SLURM_GPUS_ON_NODE
fi
slots=${slots:-1}
if ! [[ "$slots" =~ ^[1-9][0-9]*$ ]]; then
    echo "$me: slots per node '$slots' is not a positive whole number (set SLOTS)" >&2
    exit 1
fi

if ! hosts=$("$scontrol" show hostnames "$nodelist"); then
    echo "$me: 'scontrol show hostnames $nodelist' failed" >&2
    exit 1
fi
# Nodes being drained: "NAME STATE[: REASON]" for each, from the node records, which are
# "NodeName=..." lines followed by indented "Key=value" lines (or one line each with -o).
declare -A drain=()
if [[ "${NOTICES:-1}" != 0 ]]; then
    if ! records=$("$scontrol" show node "$nodelist"); then
        echo "$me: 'scontrol show node $nodelist' failed (see above); NOTICES=0 skips the drain check" >&2
        exit 1
    fi
    while read -r node why; do
        drain[$node]=$why
    done < <(awk '
        function leaving(state,   parts, n, i, p) {
            n = split(state, parts, "+")
            for (i = 1; i <= n; i++) {
                p = parts[i]
                sub(/[*~#!%$@^-]+$/, "", p)  # sinfo-style suffixes: not responding, powered off, ...
                if (p ~ /^(DRAIN|DRAINING|DRAINED|FAIL|FAILING)$/) return 1
            }
            return 0
        }
        /^NodeName=/ { node = substr($1, 10); order[++count] = node }
        node != "" && !(node in state) {
            for (i = 1; i <= NF; i++) if ($i ~ /^State=/) { state[node] = substr($i, 7); break }
        }
        node != "" && /^[[:space:]]+Reason=/ { r = $0; sub(/^[[:space:]]+Reason=/, "", r); reason[node] = r }
        END {
            for (k = 1; k <= count; k++) {
                node = order[k]
                if (leaving(state[node])) print node, state[node] ((node in reason) ? ": " reason[node] : "")
            }
        }' <<<"$records")
fi

exclude=${EXCLUDE_FILE:-}
for host in $hosts; do
    if [[ -n "$exclude" && -r "$exclude" ]] && grep -qxF "$host" "$exclude"; then
        continue
    fi
    if [[ -n "${drain[$host]+set}" ]]; then
        echo "$host:$slots draining  # ${drain[$host]}"
    else
        echo "$host:$slots"
    fi
done
