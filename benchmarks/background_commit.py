"""What a commit costs a training loop, synchronous against ``TorchState(background_commit=True)``.

    python benchmarks/background_commit.py [--sizes 16,128] [--every 1] [--steps 10] [--rounds 9]

For each state size (an MLP of 4 square layers with SGD-momentum, model + optimizer state
of about ``size`` MiB), a training loop runs blocks of ``--steps`` steps with a commit every
``--every`` steps in three modes, interleaved round by round (order rotating):

  none        no commit (the baseline)
  sync        ``state.commit()`` copies everything on the training thread
  background  the same commit with ``background_commit=True``: the parameters and optimizer
              state are copied by a thread; the next ``optimizer.step()`` waits for it

Cost per commit = (median block time of the mode - that of ``none``) / commits per block,
next to the memcpy floor (``dst.copy_(src)`` of the same bytes, pre-allocated).

It runs in two setups, one after the other (never concurrently: timings on 2 cores go wrong
under load):
  (1) one process, torch on 1 thread: a core is idle, as on a GPU host whose CPU mostly waits;
  (2) a 2-rank job (``elasticrun -np 2 -H localhost:2``, 1 thread each): no core is idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _jobs import json_result

HERE = os.path.abspath(__file__)
MiB = 1 << 20


def run_worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rows = []
    for mb in args.sizes:
        width = int((mb * MiB / 4 / 2 / 4) ** 0.5)  # weights + momentum, 4 square layers
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9),
                                       named_parameters=model.named_parameters())
        data, target = torch.randn(args.batch_size, width), torch.randn(args.batch_size, width)
        states = {"sync": hvd.elastic.TorchState(model, opt, background_commit=False, step=0),
                  "background": hvd.elastic.TorchState(model, opt, background_commit=True, step=0)}
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 2
        src = torch.rand(nbytes // 4)
        dst = torch.empty_like(src)

        def block(mode: str):
            def run() -> None:
                state = states.get(mode)
                for i in range(args.steps):
                    opt.zero_grad()
                    F.mse_loss(model(data), target).backward()
                    opt.step()
                    if state is not None and (i + 1) % args.every == 0:
                        state.commit()
                if state is not None:
                    state.wait_for_commit()  # the block owns its copies
            return run

        modes = ["none", "sync", "background"]
        times: dict[str, list[float]] = {m: [] for m in modes}
        copies: list[float] = []
        for r in range(args.rounds + 1):  # round 0 warms up
            order = modes[r % 3:] + modes[:r % 3]  # the same on every rank: collectives match
            for m in order:
                start = time.perf_counter()
                block(m)()
                if r:
                    times[m].append(time.perf_counter() - start)
            start = time.perf_counter()
            dst.copy_(src)
            if r:
                copies.append(time.perf_counter() - start)
        commits = args.steps // args.every
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append({"mb": nbytes / MiB, "step_ms": med["none"] * 1e3 / args.steps,
                     "copy_ms": statistics.median(copies) * 1e3,
                     "sync_ms": (med["sync"] - med["none"]) * 1e3 / commits,
                     "background_ms": (med["background"] - med["none"]) * 1e3 / commits})
    if hvd.rank() == 0:
        print(json.dumps({"background": rows}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,128", help="MiB of model+optimizer state")
    p.add_argument("--every", type=int, default=1, help="commit every N steps")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--skip", choices=["one", "two"], help="skip the 1-process or the 2-rank setup")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = [float(s) for s in str(args.sizes).split(",")]
    if args.worker:
        run_worker(args)
        return
    common = ["--worker", "--sizes", ",".join(f"{s:g}" for s in args.sizes), "--every", str(args.every),
              "--steps", str(args.steps), "--rounds", str(args.rounds), "--batch-size", str(args.batch_size)]
    setups = []
    if args.skip != "one":
        setups.append(("1 process, 1 torch thread (a core idle)", [sys.executable, HERE, *common]))
    if args.skip != "two":
        setups.append(("2 ranks, 1 thread each (no core idle)",
                       [sys.executable, "-m", "elasticrun", "-np", "2", "-H", "localhost:2", "--log-level",
                        "WARNING", sys.executable, HERE, *common]))
    print(f"commit every {args.every} step(s); median over {args.rounds} rounds of {args.steps} steps; "
          f"ms per commit = (block - no-commit block) / commits")
    print(f"{'setup':<42} {'state':>7} {'step':>8} {'copy_':>8} {'sync':>8} {'background':>11} "
          f"{'sync/copy_':>11} {'bg/copy_':>9} {'bg/sync':>8}")
    for label, cmd in setups:
        for r in json_result(cmd, '{"background"', timeout=1200)["background"]:
            print(f"{label:<42} {r['mb']:>4.0f} MB {r['step_ms']:>8.2f} {r['copy_ms']:>8.2f} {r['sync_ms']:>8.2f} "
                  f"{r['background_ms']:>11.2f} {r['sync_ms'] / r['copy_ms']:>11.2f} "
                  f"{r['background_ms'] / r['copy_ms']:>9.2f} {r['background_ms'] / r['sync_ms']:>8.2f}")


if __name__ == "__main__":
    main()
