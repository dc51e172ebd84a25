"""Measuring another checkout's code in the same run (``--baseline-tree DIR``): the benchmark
runs itself again in a process of its own that imports DIR's ``elasticrun``, and reads back
the one JSON line that process prints.

A script adds the options with :func:`add_arguments`, calls :func:`setup` after parsing (which
puts the chosen tree first on ``sys.path``), prints its measurement as JSON when ``--json`` is
given, and gets another tree's with :func:`measure_in`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--baseline-tree", metavar="DIR", help=f"also measure {what} of the checkout in DIR")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # (how a baseline run reports)
    p.add_argument("--tree", default=ROOT, help=argparse.SUPPRESS)  # (whose elasticrun to import)


def setup(p: argparse.ArgumentParser, a: argparse.Namespace, needs: str) -> None:
    """Refuse a baseline tree without ``needs`` (a path inside it); import ``--tree``'s code."""
    if a.baseline_tree and not os.path.isfile(os.path.join(a.baseline_tree, needs)):
        p.error(f"--baseline-tree {a.baseline_tree}: no {needs} there")
    sys.path.insert(0, a.tree)


def measure_in(script: str, tree: str, args: list[str], timeout: float = 1800) -> Any:
    """Run ``script`` with ``args`` in a process importing ``tree``'s elasticrun; its JSON result."""
    cmd = [sys.executable, os.path.abspath(script), "--json", "--tree", os.path.abspath(tree), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"the measurement of {tree} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
