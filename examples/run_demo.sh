#!/usr/bin/env bash
# elasticrun demo: train a digits classifier while the set of hosts changes under it.
#
#   bash examples/run_demo.sh            (from any directory)
#
# Installs what is missing (torch==2.13.0 first, then this package with its `examples`
# extra), then starts 2 workers on this machine ("hosts" localhost and 127.0.0.1).
# examples/discover_hosts.sh adds a third host (127.0.0.2) after DEMO_ADD_AFTER seconds
# and removes 127.0.0.1 after DEMO_REMOVE_AFTER seconds; training carries on through both
# changes without restarting, and rank 0 prints the test accuracy at the end.
# Takes about 30-60 s on a 2-core machine.
#
# Environment: PYTHON (default python), DEMO_STATE_DIR, DEMO_ADD_AFTER (default 12),
# DEMO_REMOVE_AFTER (default 24), SLEEP_PER_BATCH (default 0.1).
set -euo pipefail

# Run from the repository root, wherever this script was called from.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python}

# --- install what is missing ----------------------------------------------------------------
if ! "$PYTHON" -c 'import torch, elasticrun, sklearn' 2>/dev/null; then
    echo "run_demo.sh: installing the missing packages" >&2
    # torch first and pinned, so that nothing below ever pulls an unpinned (CUDA) build.
    if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
        "$PYTHON" -m pip install torch==2.13.0
    fi
    "$PYTHON" -m pip install -e '.[examples]'
fi
if command -v elasticrun >/dev/null 2>&1; then
    ELASTICRUN=(elasticrun)
else
    ELASTICRUN=("$PYTHON" -m elasticrun)  # installed, but its script dir is not on PATH
fi

# --- reset the demo schedule ------------------------------------------------------------------
# discover_hosts.sh times its host changes from a stamp it writes on its first run: a new
# private directory for this run (mktemp: no name a neighbour could have taken first).
if [[ -z "${DEMO_STATE_DIR:-}" ]]; then
    DEMO_STATE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/elasticrun-demo.XXXXXX")
    trap 'rm -rf "$DEMO_STATE_DIR"' EXIT
fi
export DEMO_STATE_DIR
export DEMO_ADD_AFTER=${DEMO_ADD_AFTER:-12}
export DEMO_REMOVE_AFTER=${DEMO_REMOVE_AFTER:-24}
rm -f "$DEMO_STATE_DIR/started"

echo "run_demo.sh: 127.0.0.2 joins after ${DEMO_ADD_AFTER} s, 127.0.0.1 leaves after ${DEMO_REMOVE_AFTER} s" >&2
set -x
time "${ELASTICRUN[@]}" -np 2 --min-np 1 --max-np 3 \
    --host-discovery-script examples/discover_hosts.sh --discovery-interval 0.5 \
    "$PYTHON" examples/train_digits.py --sleep-per-batch "${SLEEP_PER_BATCH:-0.1}"
