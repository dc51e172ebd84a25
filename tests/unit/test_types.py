"""The type checker passes on what it covers (pyproject.toml's [tool.mypy]: the whole package),
with no ignore left unexplained: a new one must say why on its line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


def test_mypy_passes():
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull], cwd=REPO,
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Success" in r.stdout


def _mypy_config() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]


def test_every_ignore_in_the_checked_code_says_why():
    checked = _mypy_config()["files"]
    assert checked == ["elasticrun"], checked  # every module: a new one is checked from its first line
    bare = []
    for root in checked:
        path = REPO / root
        for p in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                m = re.search(r"#\s*type:\s*ignore(\[[^\]]*\])?(.*)$", line)
                if m and not re.search(r"#\s*\S", m.group(2)):
                    bare.append(f"{p.relative_to(REPO)}:{n}")
    assert not bare, f"a `# type: ignore` needs a reason after it (`# type: ignore[code]  # why`): {bare}"
