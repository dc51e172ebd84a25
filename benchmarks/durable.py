"""What durable copies (--checkpoint-dir) cost the training, and how often a big state can be copied.

    python benchmarks/durable.py [--seconds 70] [--repeats 2] [--big-gb 1.0]

(1) Overhead: a 2-rank job (hosts localhost and 127.0.0.1) trains a model for --seconds,
    committing every 10 steps inside hvd.elastic.run, with and without --checkpoint-dir at the
    default --checkpoint-interval (60 s: copies at the start and after a minute), interleaved
    (without, with, without, with, ...). Prints steps/s of each and the median ratio with/without,
    for a tiny state and a 128 MB one (model + SGD momentum). Target: >= 0.97.
(2) A --big-gb state with --checkpoint-interval 1: copies are asked for as fast as they can be
    made; the spacing of the copies written is the interval this machine can sustain, and the
    training thread's hand-off (copying its shard into staging) is what a copy costs a step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hvd.init()
    width = args.width
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(args.layers)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    x, y = torch.randn(8, width), torch.randn(8, width)
    times: list[float] = []

    @hvd.elastic.run
    def train(state):
        end = time.time() + args.seconds
        while True:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            state.step += 1
            times.append(time.perf_counter())
            if state.step % 10 == 0:
                state.commit()
                # Every rank stops at the same step: rank 0's clock decides.
                if hvd.broadcast(torch.tensor([float(time.time() >= end)]), root_rank=0).item():
                    break

    train(state)
    warm = [t for t in times if t >= times[0] + args.warmup]
    if hvd.rank() == 0:
        print("DURABLE-RESULT " + json.dumps({"steps_per_s": (len(warm) - 1) / (warm[-1] - warm[0]),
                                              "steps": len(times)}), flush=True)


def job(args, state_mb: float, durable: bool, interval: float | None = None) -> dict:
    # width^2 * 4 bytes per layer, twice (parameters and momentum): layers of 2048 x 2048 (16 MB).
    width = 2048 if state_mb >= 64 else 64
    layers = max(1, round(state_mb * 1e6 / (2 * 4 * width * width)))
    tmp = tempfile.mkdtemp(prefix="elasticrun-durable-")
    events = os.path.join(tmp, "events.jsonl")
    cmd = [sys.executable, "-m", "elasticrun", "-np", "2", "-H", "localhost:1,127.0.0.1:1", "--events", events]
    if durable:
        cmd += ["--checkpoint-dir", os.path.join(tmp, "ckpt")]
        if interval is not None:
            cmd += ["--checkpoint-interval", str(interval)]
    cmd += [sys.executable, HERE, "--worker", "--seconds", str(args.seconds), "--width", str(width),
            "--layers", str(layers), "--warmup", str(args.warmup)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 300,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        result = None
        for line in out.stdout.splitlines():
            text = line.split(">:", 1)[-1]
            if text.startswith("DURABLE-RESULT "):
                result = json.loads(text[len("DURABLE-RESULT "):])
        if result is None:
            raise RuntimeError(f"no result (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        with open(events) as f:
            ev = [json.loads(line) for line in f]
        written = [e for e in ev if e["kind"] == "durable_written"]
        result.update(copies=len(written), copy_seconds=[e["seconds"] for e in written],
                      copy_bytes=[e["bytes"] for e in written], copy_times=[e["t"] for e in written],
                      state_mb=2 * 4 * width * width * layers / 1e6)
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def overhead(args, state_mb: float) -> None:
    plain, durable = [], []
    for _ in range(args.repeats):
        plain.append(job(args, state_mb, False))
        durable.append(job(args, state_mb, True))
    ratios = [d["steps_per_s"] / p["steps_per_s"] for p, d in zip(plain, durable)]
    mb = durable[0]["state_mb"]
    print(f"{mb:7.1f} MB state: steps/s without {statistics.median(p['steps_per_s'] for p in plain):.1f}, with "
          f"--checkpoint-dir (interval 60 s) {statistics.median(d['steps_per_s'] for d in durable):.1f}; "
          f"ratio {statistics.median(ratios):.3f} (per repeat {' '.join(f'{r:.3f}' for r in ratios)}); "
          f"copies per run {[d['copies'] for d in durable]}, each written in "
          f"{statistics.median(s for d in durable for s in d['copy_seconds']):.2f} s", flush=True)


def sustained(args) -> None:
    r = job(args, args.big_gb * 1000, True, interval=1.0)
    t = r["copy_times"]
    gaps = [b - a for a, b in zip(t, t[1:])]
    print(f"{r['state_mb']:7.1f} MB state, --checkpoint-interval 1: {r['copies']} copies in {args.seconds} s; "
          f"each written in {statistics.median(r['copy_seconds']):.1f} s (median); copies every "
          f"{statistics.median(gaps) if gaps else float('nan'):.1f} s: the interval this machine sustains; "
          f"{r['steps_per_s']:.2f} steps/s while copying", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=70.0, help="training time per job")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds not counted at the start")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sizes", default="0.01,128", help="state sizes of part (1), MB, comma-separated")
    p.add_argument("--big-gb", type=float, default=1.0, help="state size of part (2), GB (0: skip)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    print("2 ranks (localhost, 127.0.0.1), commit every 10 steps; durable copies at the default interval (60 s)")
    for mb in args.sizes.split(","):
        overhead(args, float(mb))
    if args.big_gb > 0:
        sustained(args)


if __name__ == "__main__":
    main()
