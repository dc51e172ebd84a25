#!/usr/bin/env bash
# Install what the test suite needs (if missing) and run it. Used by the README and .ci/run.
#   ./run_tests.sh            # whole suite
#   ./run_tests.sh tests/unit # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

# torch first, pinned: an unpinned torch would pull several GB of CUDA packages.
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
  "$PYTHON" -m pip install --quiet torch==2.13.0
fi
if ! "$PYTHON" -c 'import elasticrun, zmq, cloudpickle, paramiko, pytest, pytest_timeout, hypothesis, sklearn' 2>/dev/null \
   || ! command -v elasticrun >/dev/null; then
  "$PYTHON" -m pip install --quiet -e '.[test]'
fi

exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
