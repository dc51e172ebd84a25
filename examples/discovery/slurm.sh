#!/usr/bin/env bash
# Discovery recipe: the nodes of the current Slurm allocation.
#
# Run elasticrun inside the allocation (sbatch/salloc), e.g.:
#   elasticrun -np 8 --min-np 4 --host-discovery-script examples/discovery/slurm.sh python train.py
#
# Slots per node: $SLOTS, else the leading number of $SLURM_NTASKS_PER_NODE, else
# $SLURM_GPUS_ON_NODE, else 1. A node whose name is listed in $EXCLUDE_FILE (one per line,
# optional) is left out: write a node there to drain it from the job by hand.
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
exclude=${EXCLUDE_FILE:-}
for host in $hosts; do
    if [[ -n "$exclude" && -r "$exclude" ]] && grep -qxF "$host" "$exclude"; then
        continue
    fi
    echo "$host:$slots"
done
