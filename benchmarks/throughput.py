"""Training throughput: elasticrun's DistributedOptimizer against torch DDP, same model, same run.

    python benchmarks/throughput.py [--hidden 1024] [--layers 4] [--batch-size 64] [--steps 60]

Runs three 2-process jobs one after the other (never concurrently: timings on 2 cores go
wrong under load) and prints samples/s and the ratios to DDP:

  (a) torch DistributedDataParallel on gloo (the baseline)
  (b) hvd.DistributedOptimizer, launched by elasticrun
  (c) (b) inside hvd.elastic.run, committing every --commit-every steps and calling
      state.check_host_updates() every step
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


def build(args):
    import torch

    torch.manual_seed(0)
    layers, width = [], 64
    for _ in range(args.layers):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.ReLU()]
        width = args.hidden
    layers.append(torch.nn.Linear(width, 10))
    model = torch.nn.Sequential(*layers)
    data = torch.randn(args.batch_size, 64)
    target = torch.randint(0, 10, (args.batch_size,))
    return model, data, target


def timed_steps(step, args) -> float:
    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return args.steps * args.batch_size / (time.perf_counter() - start)


def run_ddp(rank: int, args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2)
    model, data, target = build(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        F.cross_entropy(ddp(data), target).backward()
        opt.step()

    rate = timed_steps(step, args)
    if rank == 0:
        print(json.dumps({"samples_per_s": rate * 2}), flush=True)
    dist.destroy_process_group()


def run_hvd(args, elastic: bool) -> None:
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model, data, target = build(args)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    if not elastic:
        rate = timed_steps(step, args)
    else:
        state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

        @hvd.elastic.run
        def train(state):
            def elastic_step():
                step()
                state.step += 1
                if state.step % args.commit_every == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            return timed_steps(elastic_step, args)

        rate = train(state)
    if hvd.rank() == 0:
        print(json.dumps({"samples_per_s": rate * hvd.size()}), flush=True)


def launch(mode: str, args) -> float:
    common = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--commit-every", str(args.commit_every)]
    if mode == "ddp":
        cmd = [sys.executable, HERE, "--worker", "ddp", *common]
    else:
        cmd = [sys.executable, "-m", "elasticrun", "-np", "2", "-H", "localhost:2", "--log-level", "WARNING",
               sys.executable, HERE, "--worker", mode, *common]
    return json_result(cmd, "{")["samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is reported")
    p.add_argument("--worker", choices=["ddp", "hvd", "elastic"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker == "ddp":
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
        mp.spawn(run_ddp, args=(args,), nprocs=2)
        return
    if args.worker in ("hvd", "elastic"):
        run_hvd(args, elastic=args.worker == "elastic")
        return

    params = (64 * args.hidden + args.hidden) + (args.layers - 1) * (args.hidden ** 2 + args.hidden) + args.hidden * 10 + 10
    print(f"MLP {args.layers}x{args.hidden} ({params * 4 / 1e6:.1f} MB of fp32 gradients), batch {args.batch_size} "
          f"per rank, 2 ranks, {args.steps} timed steps, median of {args.repeats} interleaved runs")
    # Interleaved (a, b, c, a, b, c, ...): this machine's speed drifts by 10 % over minutes,
    # which sequential blocks would turn into a difference between the modes.
    modes = ("ddp", "hvd", "elastic")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(launch(mode, args))
    # Ratios per repeat (each against the DDP run next to it), then their median.
    ratios = {m: statistics.median(r / d for r, d in zip(runs[m], runs["ddp"])) for m in modes}
    print(f"{'mode':<52} {'samples/s':>10} {'ratio to DDP':>13}  (per-repeat ratios)")
    labels = {"ddp": "(a) torch DDP, gloo", "hvd": "(b) hvd.DistributedOptimizer",
              "elastic": f"(c) (b) + elastic.run, commit/{args.commit_every}, check every step"}
    for mode in modes:
        each = " ".join(f"{r / d:.3f}" for r, d in zip(runs[mode], runs["ddp"]))
        print(f"{labels[mode]:<52} {statistics.median(runs[mode]):>10.0f} {ratios[mode]:>13.3f}  ({each})")


if __name__ == "__main__":
    main()
