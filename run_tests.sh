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
# Install this checkout unless the elasticrun that $PYTHON imports is this very checkout, with
# its console script beside $PYTHON: asked from outside the repository (from its root, the
# source directory itself would answer), so another checkout's install, or a deleted one's
# leftover `elasticrun` on PATH, is never what the tests run.
here=$(pwd -P)
installed=$(cd / && "$PYTHON" - <<'PY' 2>/dev/null
import os, sysconfig
import elasticrun, zmq, cloudpickle, paramiko, pytest, pytest_timeout, hypothesis, sklearn, matplotlib, mypy
script = os.path.join(sysconfig.get_path("scripts"), "elasticrun")
print(os.path.dirname(os.path.dirname(os.path.realpath(elasticrun.__file__))) if os.path.exists(script) else "")
PY
) || installed=""
if [ "$installed" != "$here" ]; then
  "$PYTHON" -m pip install --quiet -e '.[test]'
fi

# The Ray tests (tests/integration/test_ray.py) start a local multi-node Ray cluster. Ray is an
# optional extra (elasticrun[ray]), pinned, installed after torch so that it cannot pull another
# torch. CI must run them: a failed install fails the run (ELASTICRUN_TESTS_WITHOUT_RAY=1 skips it;
# the Ray tests then skip themselves, saying so).
if [ "${ELASTICRUN_TESTS_WITHOUT_RAY:-0}" != 1 ] && ! "$PYTHON" -c 'import ray, nacl' 2>/dev/null; then
  "$PYTHON" -m pip install --quiet 'ray==2.60.0' 'pynacl>=1.5'
fi

# The SSH tests start a real sshd (tests/integration/sshd.py): install it if missing and we can.
if ! [ -x /usr/sbin/sshd ] && ! command -v sshd >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      openssh-server; } >/dev/null 2>&1 \
    || echo "run_tests.sh: could not install openssh-server; the SSH tests will be skipped" >&2
fi

# -rs: every skipped test says why (a missing sshd, not root, no Ray); --durations: the slowest
# tests are named at the end, so that a suite creeping past CI's time says where.
exec "$PYTHON" -m pytest -q -rs --durations=40 -p no:cacheprovider "$@"
