"""Horovod programs, ported by changing their import line only, run under elasticrun.

``tests/compat/horovod/`` holds programs written against ``horovod.torch`` after Horovod's
own examples (digits instead of MNIST, elastic and not, the synthetic benchmark, the elastic
main script of Horovod's integration tests). Each test copies one, replaces
``import horovod.torch as hvd`` with ``import elasticrun.torch as hvd`` (and checks that
nothing else changed), and runs it with ``elasticrun`` on 2 ranks of this machine.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "horovod"

# The integration tests' job runner (real elasticrun jobs, nothing left behind), loaded
# under its own name: both directories' conftest modules would otherwise be "conftest".
_spec = importlib.util.spec_from_file_location("integration_jobs", HERE.parent / "integration" / "conftest.py")
assert _spec is not None and _spec.loader is not None
jobs = importlib.util.module_from_spec(_spec)
sys.modules["integration_jobs"] = jobs
_spec.loader.exec_module(jobs)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def job(tmp_path: Path):
    j = jobs.Job(tmp_path)
    yield j
    if j.proc is not None and j.proc.poll() is None:
        import os
        import signal
        os.killpg(j.proc.pid, signal.SIGKILL)
        j.proc.wait()
    jobs.assert_nothing_left(j.tag)


def port(name: str, into: Path) -> Path:
    """The program ported to elasticrun: its import line changed, nothing else."""
    original = (PROGRAMS / name).read_text().splitlines(keepends=True)
    ported = [line.replace("import horovod.torch as hvd", "import elasticrun.torch as hvd") for line in original]
    changed = [d for d in difflib.unified_diff(original, ported, n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    assert changed == ["-import horovod.torch as hvd\n", "+import elasticrun.torch as hvd\n"], changed
    assert not any("horovod" in line for line in ported if line.lstrip().startswith(("import", "from")))
    target = into / name
    target.write_text("".join(ported))
    return target


def run(job, program: Path, *args: str, launcher: list[str] | None = None, timeout: float = 180):
    result = job.run(launcher or ["-np", "2", "-H", "localhost:2"], [sys.executable, str(program), *args],
                     timeout=timeout)
    assert result.returncode == 0, result.output[-4000:]
    return result


@pytest.mark.parametrize("extra", [[], ["--fp16-allreduce"], ["--use-adasum"]], ids=["average", "fp16", "adasum"])
def test_pytorch_digits(job, tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "result.json"
    run(job, port("pytorch_digits.py", tmp_path), "--epochs", "5", "--result", str(out), *extra)
    result = json.loads(out.read_text())
    assert result["size"] == 2 and result["accuracy"] > 0.8, result


def test_pytorch_digits_elastic(job, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    r = run(job, port("pytorch_digits_elastic.py", tmp_path), "--epochs", "5", "--result", str(out),
            launcher=["-np", "2", "--min-np", "1", "--max-np", "2", "-H", "localhost:1,127.0.0.2:1"])
    result = json.loads(out.read_text())
    assert result["size"] == 2 and result["accuracy"] > 0.8, (result, r.output[-2000:])


@pytest.mark.parametrize("name", ["pytorch_synthetic_benchmark.py", "pytorch_synthetic_benchmark_elastic.py"])
def test_pytorch_synthetic_benchmark(job, tmp_path: Path, name: str) -> None:
    r = run(job, port(name, tmp_path), "--num-iters", "2", "--fp16-allreduce")
    line = next(x for x in r.stdout.splitlines() if "Total img/sec on 2 CPU(s)" in x)
    assert float(line.split(":")[-1].split("+-")[0]) > 0


def elastic_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_elastic_integration_main_without_failures(job, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    run(job, port("elastic_torch_main.py", tmp_path), "--epochs", "2", "--batches-per-epoch", "4",
        "--logfile", str(log))
    lines = elastic_log(log)
    assert [(x["epoch"], x["size"], x["rank"], x["rendezvous"]) for x in lines] == [(0, 2, 0, 1), (1, 2, 0, 1)]
    assert lines[0]["hostname"] == "localhost" and lines[0]["start_rank"] == 0


@pytest.mark.parametrize("mode", ["exception", "kill"])
def test_elastic_integration_main_survives_a_failing_worker(job, tmp_path: Path, mode: str) -> None:
    """Start rank 1 fails at epoch 1, batch 2; the other carries on alone from its last commit."""
    log = tmp_path / "log.jsonl"
    run(job, port("elastic_torch_main.py", tmp_path), "--epochs", "3", "--batches-per-epoch", "4",
        "--logfile", str(log), "--exit-mode", mode, "--exit-schedule", json.dumps({"[1, 2]": [1]}),
        launcher=["-np", "2", "--min-np", "1", "--max-np", "2", "-H", "localhost:1,127.0.0.2:1"])
    lines = elastic_log(log)
    assert [(x["epoch"], x["size"]) for x in lines] == [(0, 2), (1, 1), (2, 1)]
    assert lines[-1]["rendezvous"] == 2 and lines[-1]["batch"] == 4


def test_elastic_integration_main_waits_for_the_drivers_word_of_a_host_change(job, tmp_path: Path) -> None:
    """Horovod's program polls ``state._host_messages`` at an epoch's end until the driver's
    notification of the host its schedule expects comes (a private attribute of Horovod's
    State, which its own tests use): here discovery lists a second host once epoch 0 is logged."""
    log = tmp_path / "log.jsonl"
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\necho localhost:1\nif [ -s {log} ]; then echo 127.0.0.2:1; fi\n")
    discover.chmod(0o700)
    schedule = [[0, ["localhost:1"]], [None, ["localhost:1", "127.0.0.2:1"]]]
    r = run(job, port("elastic_torch_main.py", tmp_path), "--epochs", "2", "--batches-per-epoch", "3",
            "--logfile", str(log), "--discovery-schedule", json.dumps(schedule), "--discovery-wait", "60",
            launcher=["-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discover)])
    assert "host changes: ['localhost:1'] -> ['localhost:1', '127.0.0.2:1']" in r.stdout, r.output[-3000:]
    lines = elastic_log(log)
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [(0, 1, 1), (1, 2, 2)]
