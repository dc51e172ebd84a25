"""Fault matrix: every fault scenario of tests/integration/test_fault_phases.py, K times each.

    python benchmarks/fault_matrix.py [--trials 3] [--only rank0,host] [--keep DIR]

Each trial is a real ``python -m elasticrun`` job of tests/integration/scripts/fault_train.py,
which SIGKILLs the chosen worker(s) at a named phase and logs the committed history (sample
indices and a model + optimizer checksum per commit). One row per scenario:

* **passed**: the job ended as the scenario expects (success on the expected world size, or a
  failure naming --elastic-timeout below --min-np), with the history checks below all clean;
* **recovery**: from the (last) injected fault to the first completed step on the new world:
  the event log's first ``first_step`` event after the fault (for faults before any training,
  where no reset happens inside ``elastic.run``, the first step the script logged after it);
* **lost / duplicated**: committed sample indices missing from / repeated in an epoch, summed
  over the trials (lost is not counted for the below-min-np job, which stops mid-training);
* **checksum**: commits whose model checksums differ between ranks;
* **leftover**: processes of the job (tagged through their environment) alive after it ended.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from conftest import tagged_pids  # noqa: E402
from test_fault_phases import EPOCHS, SAMPLES, SCENARIOS, fault_cmd, read_history  # noqa: E402

from elasticrun.common.events import read_events  # noqa: E402


def leftovers(tag: str, within: float = 10.0) -> int:
    """Processes of the job still alive ``within`` s after it ended (then killed, counted)."""
    deadline = time.monotonic() + within
    while True:
        left = tagged_pids(tag)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(left)


def recovery_seconds(events_file: Path, log_dir: Path, faults: list[dict]) -> float | None:
    if not faults:
        return None
    fault_t = max(f["t"] for f in faults)
    steps = [e["t"] for e in read_events(str(events_file)) if e["kind"] == "first_step" and e["t"] > fault_t]
    if not steps:  # faults before training: no reset inside elastic.run, so use the script's log
        import json

        steps = [json.loads(line)["t"] for p in log_dir.glob("steps-*.jsonl")
                 for line in p.read_text().splitlines() if json.loads(line)["t"] > fault_t]
    return min(steps) - fault_t if steps else None


def trial(name: str, work: Path) -> dict:
    scenario = SCENARIOS[name]
    work.mkdir(parents=True)
    log_dir, events_file, tag = work / "samples", work / "events.jsonl", uuid.uuid4().hex
    env = dict(os.environ, ELASTICRUN_TEST_TAG=tag, OMP_NUM_THREADS="1")
    env.pop("ELASTICRUN_CONTROL_ADDR", None)
    cmd = [sys.executable, "-m", "elasticrun", *scenario.launcher, "--events", str(events_file),
           *fault_cmd(log_dir, scenario)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += "\n[fault_matrix] the job did not finish within 120 s"
    seconds = time.monotonic() - started
    left = leftovers(tag)
    h = read_history(log_dir)
    problems = []
    if len(h.faults) != len(scenario.faults):
        problems.append(f"{len(h.faults)} of {len(scenario.faults)} faults fired")
    if scenario.final_size is None:
        if proc.returncode == 0:
            problems.append("the job succeeded below --min-np")
    elif proc.returncode != 0:
        problems.append(f"exit code {proc.returncode}")
    problems += [f"stderr lacks {t!r}" for t in scenario.expect_stderr if t not in err]
    lost = h.lost(EPOCHS, SAMPLES) if scenario.complete else 0
    dup, bad_sums = h.duplicated(), len(h.disagreeing())
    if lost or dup or bad_sums or left:
        problems.append(f"lost {lost}, duplicated {dup}, checksum mismatches {bad_sums}, leftover {left}")
    rec = recovery_seconds(events_file, log_dir, h.faults) if events_file.exists() else None
    if problems:
        (work / "output.txt").write_text(out + "\n--- stderr ---\n" + err)
    return {"ok": not problems, "problems": problems, "recovery": rec, "lost": lost, "dup": dup,
            "sums": bad_sums, "left": left, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", "-k", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument("--keep", default=None, help="keep every trial's logs under this directory")
    a = p.parse_args()
    names = [n for n in a.only.split(",") if n] or list(SCENARIOS)
    base = Path(a.keep or tempfile.mkdtemp(prefix="fault-matrix-"))
    header = ("| scenario | trials | passed | recovery p50 ms | recovery max ms | lost | duplicated "
              "| checksum mismatches | leftover | job s (p50) |")
    rows = [header, "| " + " | ".join(["---"] * 10) + " |"]
    total_bad = 0
    for name in names:
        results = []
        for k in range(a.trials):
            r = trial(name, base / f"{name}-{k}")
            results.append(r)
            if not r["ok"]:
                print(f"[fault_matrix] {name} trial {k} FAILED: {'; '.join(r['problems'])} "
                      f"(logs in {base / f'{name}-{k}'})", file=sys.stderr, flush=True)
        recs = [r["recovery"] * 1000 for r in results if r["recovery"] is not None]
        passed = sum(r["ok"] for r in results)
        total_bad += len(results) - passed
        row = (f"| {name} | {len(results)} | {passed} | "
               f"{statistics.median(recs):.0f} | {max(recs):.0f} | " if recs else f"| {name} | {len(results)} | "
               f"{passed} | - | - | ")
        row += (f"{sum(r['lost'] for r in results)} | {sum(r['dup'] for r in results)} | "
                f"{sum(r['sums'] for r in results)} | {sum(r['left'] for r in results)} | "
                f"{statistics.median(r['seconds'] for r in results):.1f} |")
        rows.append(row)
        print(row, flush=True)
    print("\n" + "\n".join(rows))
    if not a.keep and total_bad == 0:
        shutil.rmtree(base, ignore_errors=True)
    sys.exit(1 if total_bad else 0)


if __name__ == "__main__":
    main()
