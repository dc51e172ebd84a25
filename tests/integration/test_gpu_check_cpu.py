"""benchmarks/gpu_check.py is run on a lent GPU machine, rarely: run it here on CPU tensors
(``--device cpu --quick``) so that it cannot rot between those runs, and so that its jobs
(every path of the facade, a kill, resets, a durable copy resumed, the commit figures) run
in CI too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_the_gpu_check_runs_on_cpu_tensors_and_every_correctness_row_holds(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    table = out.stdout
    assert "27/27 paths right; CUDA tensors over gloo" in table, table
    assert "resumed at epoch " in table and "5 resets, gloo" in table, table
    for line in table.splitlines():
        if "resets" in line or "paths" in line or "kill" in line:
            assert line.rstrip().endswith("| yes |"), line
