"""The documentation cannot rot: its runnable code blocks run, and its references exist.

Marking: a fenced block whose info string is ``bash test`` or ``python test`` is run;
any other block (``bash``, ``python``, ``toml``, no tag) is an illustration that needs a
cluster, a network or an install, and is not. The runnable blocks of one document run in order, each in
its own process, in one fresh temporary directory (so a block may use a file an earlier one
wrote) that holds a copy of ``examples/``, as the repository root would, as a reader would run
them: no variable is set that the reader is not told to set (no ``$REPO``), and no
``ELASTICRUN_*`` variable is inherited. Bash blocks run with ``set -euo pipefail``; Python blocks run in a
subprocess of this interpreter. Both are bounded by a timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
BLOCK_TIMEOUT = 45


def blocks() -> list[tuple[str, int, str, str]]:
    """(doc, line, language, code) of every runnable block in docs/*.md."""
    found = []
    for doc in sorted(DOCS.glob("*.md")):
        text = doc.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            words = match.group(1).split()
            if len(words) == 2 and words[1] == "test":
                line = text.count("\n", 0, match.start()) + 1
                found.append((doc.name, line, words[0], match.group(2)))
    return found


def test_docs_exist_and_have_runnable_blocks():
    names = {p.name for p in DOCS.glob("*.md")}
    assert {"quickstart.md", "configuration.md", "elastic-model.md", "discovery.md", "ssh.md",
            "porting-from-horovod.md", "troubleshooting.md"} <= names, names
    assert len(blocks()) >= 8
    languages = {lang for _, _, lang, _ in blocks()}
    assert languages <= {"bash", "python"}, languages  # a typo in a tag would silently skip a block


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRUN_")}
    bindir = str(Path(sys.executable).parent)  # the `elasticrun` and `python` of this interpreter
    env.pop("REPO", None)
    env.update(PATH=bindir + os.pathsep + env.get("PATH", ""), PYTHONUNBUFFERED="1")
    return env


def _docs_with_blocks() -> list[str]:
    return sorted({doc for doc, _, _, _ in blocks()})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", _docs_with_blocks())
def test_blocks_run(doc, tmp_path):
    """A doc's blocks run in order in one directory, as a reader following along would: from
    the repository root, so ``examples/`` is there (a copy: blocks may write files)."""
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    for name, line, lang, code in blocks():
        if name != doc:
            continue
        if lang == "bash":
            cmd = ["bash", "-c", "set -euo pipefail\n" + code]
        else:
            cmd = [sys.executable, "-c", code]
        try:
            r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                               timeout=BLOCK_TIMEOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"docs/{doc} line {line}: did not finish within {BLOCK_TIMEOUT} s\n{exc.stdout}\n{exc.stderr}")
        assert r.returncode == 0, \
            f"docs/{doc} line {line} exited {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"


def test_troubleshooting_headings_are_real_messages():
    """Every `literal` in a troubleshooting heading occurs in elasticrun's source."""
    source = "".join(p.read_text(encoding="utf-8") for p in (REPO / "elasticrun").rglob("*.py"))
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    headings = re.findall(r"^### (.*)$", text, re.M)
    assert len(headings) >= 20
    missing = [frag for h in headings for frag in re.findall(r"`([^`]+)`", h) if frag not in source]
    assert not missing, f"troubleshooting.md names messages the code no longer prints: {missing}"


def test_links_and_paths_exist():
    """Relative links between docs, and examples/ paths named in them, exist."""
    bad = []
    for doc in DOCS.glob("*.md"):
        text = doc.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            if not (DOCS / target).exists():
                bad.append(f"{doc.name}: link {target}")
        for path in set(re.findall(r"examples/[\w./-]+\.(?:sh|py)", text)):
            if not (REPO / path).exists():
                bad.append(f"{doc.name}: {path}")
    assert not bad, bad


def test_discovery_recipes_are_executable_and_fail_clearly_without_their_tool(tmp_path):
    recipes = sorted((REPO / "examples" / "discovery").glob("*.sh"))
    assert {p.name for p in recipes} >= {"static_file.sh", "slurm.sh", "kubernetes.sh", "aws_spot.sh",
                                         "aws_spot_notice.sh", "gce.sh", "gce_notice.sh"}
    env = dict(_env(), SCONTROL="no-such-scontrol", KUBECTL="no-such-kubectl", AWS="no-such-aws", SELECTOR="app=x", TAG="Name=x", SLURM_JOB_NODELIST="n[1-2]",
               HOSTS_FILE=str(tmp_path / "missing.txt"), GCLOUD="no-such-gcloud", LABEL="role=x", CURL="no-such-curl")
    for recipe in recipes:
        assert os.access(recipe, os.X_OK), f"{recipe} is not executable"
        r = subprocess.run([str(recipe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=20)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and r.stdout == "" and len(lines) == 1 and lines[0].startswith(recipe.name), \
            (recipe.name, r)
