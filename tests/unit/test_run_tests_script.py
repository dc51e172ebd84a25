"""run_tests.sh installs this checkout whenever the elasticrun its Python imports is another one
(issue 24): checked from outside the repository, since from its root the source directory itself
answers `import elasticrun`. Driven with a stand-in Python that records pip and pytest instead of
running them, so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _stand_in(tmp_path: Path) -> tuple[Path, Path]:
    record = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
case "$1 $2" in
  "-m pip"|"-m pytest") echo "$@" >> {record}; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    return fake, record


def _run(checkout: Path, fake: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=str(fake), ELASTICRUN_TESTS_WITHOUT_RAY="1")
    return subprocess.run(["bash", str(checkout / "run_tests.sh"), "tests/unit/test_hosts.py"], cwd=checkout,
                          env=env, capture_output=True, text=True, timeout=100)


def test_this_installed_checkout_is_tested_as_it_is(tmp_path):
    fake, record = _stand_in(tmp_path)
    out = _run(REPO, fake)
    assert out.returncode == 0, out.stderr
    calls = record.read_text().splitlines()
    assert not any(c.startswith("-m pip install") and "-e" in c for c in calls), calls
    assert calls[-1].startswith("-m pytest -q -rs"), calls  # skipped tests say why


def test_another_checkout_is_installed_before_its_tests_run(tmp_path):
    other = tmp_path / "other-checkout"
    shutil.copytree(REPO, other, ignore=shutil.ignore_patterns(".git", "*.egg-info", "__pycache__"))
    fake, record = _stand_in(tmp_path)
    out = _run(other, fake)
    assert out.returncode == 0, out.stderr
    calls = record.read_text().splitlines()
    assert "-m pip install --quiet -e .[test]" in calls, calls  # this checkout, not the installed one
