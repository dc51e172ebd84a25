"""Training throughput: elasticrun's DistributedOptimizer against torch DDP, side by side.

    python benchmarks/throughput.py [--np 2] [--fp16] [--hidden 1024] [--layers 4] [--batch-size 64]
                                    [--block 10] [--blocks 30] [--separate-optimizers]

One elasticrun job of ``--np`` ranks on this machine. Every rank builds the same MLP for DDP
and for elasticrun and trains the three modes in alternating blocks of ``--block`` steps (which
mode goes first rotates), so that all modes share the processes, the moment and the machine's
drift:

  (a) torch DistributedDataParallel, on a gloo default group formed beside the job's own
      (``MASTER_ADDR``/``MASTER_PORT`` from ``hvd.init()``); ``--fp16``: its fp16 compress hook
  (b) ``hvd.DistributedOptimizer`` (``--fp16``: ``compression=hvd.Compression.fp16``)
  (c) (b) inside ``hvd.elastic.run``, committing every ``--commit-every`` steps and calling
      ``state.check_host_updates()`` every other step

(b) and (c) train one model with one ``DistributedOptimizer``, as a script has. With
``--separate-optimizers`` each has its own: a process with two DistributedOptimizers (a GAN's
generator and discriminator) checks with the other ranks that they reduce the same bucket
before each bucket is summed, which this measures.

Each block's time per step is measured on rank 0 (every rank runs the same steps); the ratio
of a mode is the median, over the rounds of blocks, of DDP's block time over its own (above 1:
faster than DDP), with the middle half of those ratios beside it.
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
    return torch.nn.Sequential(*layers)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import elasticrun.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=hvd.rank(), world_size=hvd.size())
    data = torch.randn(args.batch_size, 64)
    target = torch.randint(0, 10, (args.batch_size,))

    ddp = torch.nn.parallel.DistributedDataParallel(build(args))
    if args.fp16:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.01)
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
    models, opts = {}, {}
    # (b) and (c) train one model with one DistributedOptimizer, as a script has: a process with
    # two checks each bucket with the other ranks before it is summed (optimizer.py, _LIVE),
    # which --separate-optimizers measures.
    for mode in ("hvd", "elastic") if args.separate_optimizers else ("hvd",):
        models[mode] = build(args)
        opts[mode] = hvd.DistributedOptimizer(torch.optim.SGD(models[mode].parameters(), lr=0.01),
                                              named_parameters=models[mode].named_parameters(),
                                              compression=compression)
    if not args.separate_optimizers:
        models["elastic"], opts["elastic"] = models["hvd"], opts["hvd"]
    state = hvd.elastic.TorchState(model=models["elastic"], optimizer=opts["elastic"], step=0)

    def step_ddp() -> None:
        opt_ddp.zero_grad()
        F.cross_entropy(ddp(data), target).backward()
        opt_ddp.step()

    def step_hvd() -> None:
        opts["hvd"].zero_grad()
        F.cross_entropy(models["hvd"](data), target).backward()
        opts["hvd"].step()

    def step_elastic() -> None:
        opts["elastic"].zero_grad()
        F.cross_entropy(models["elastic"](data), target).backward()
        opts["elastic"].step()
        state.step += 1
        if state.step % args.commit_every == 0:
            state.commit()
        elif state.step % 2 == 0:
            state.check_host_updates()

    steps = {"ddp": step_ddp, "hvd": step_hvd, "elastic": step_elastic}

    @hvd.elastic.run
    def train(state):
        for fn in steps.values():  # warm up every mode (first buckets, allocations)
            for _ in range(args.block):
                fn()
        times: dict[str, list[float]] = {m: [] for m in steps}
        order = list(steps)
        for b in range(args.blocks):
            for mode in order[b % 3:] + order[:b % 3]:
                hvd.barrier()
                start = time.perf_counter()
                for _ in range(args.block):
                    steps[mode]()
                times[mode].append((time.perf_counter() - start) / args.block)
        return times

    times = train(state)
    if hvd.rank() == 0:
        print(json.dumps({"times": times}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks (on this machine)")
    p.add_argument("--fp16", action="store_true", help="fp16 compression on both sides")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--blocks", type=int, default=30, help="blocks per mode")
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--separate-optimizers", action="store_true",
                   help="(b) and (c) each with its own model and DistributedOptimizer: two in one process, as a "
                        "GAN's script has, which check every bucket with the other ranks")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "elasticrun", "-np", str(args.np), "-H", f"localhost:{args.np}", "--log-level",
           "WARNING", sys.executable, HERE, "--worker", "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--batch-size", str(args.batch_size), "--block", str(args.block), "--blocks", str(args.blocks),
           "--commit-every", str(args.commit_every)] + (["--fp16"] if args.fp16 else []) + (
           ["--separate-optimizers"] if args.separate_optimizers else [])
    times = json_result(cmd, "{", timeout=1800)["times"]
    params = (64 * args.hidden + args.hidden) + (args.layers - 1) * (args.hidden ** 2 + args.hidden) + args.hidden * 10 + 10
    print(f"MLP {args.layers}x{args.hidden} ({params * 4 / 1e6:.1f} MB of fp32 gradients), batch {args.batch_size} per "
          f"rank, {args.np} ranks{', fp16 compression' if args.fp16 else ''}; {args.blocks} rounds of {args.block}-step "
          f"blocks, modes alternating in one job"
          + ("; (b) and (c) with a DistributedOptimizer each" if args.separate_optimizers else ""))
    print(f"{'mode':<55} {'samples/s':>10} {'vs DDP':>7}  middle half")
    labels = {"ddp": "(a) torch DDP, gloo" + (" + fp16_compress_hook" if args.fp16 else ""),
              "hvd": "(b) hvd.DistributedOptimizer" + (" (Compression.fp16)" if args.fp16 else ""),
              "elastic": f"(c) (b) + elastic.run, commit/{args.commit_every}, check/2"}
    for mode in ("ddp", "hvd", "elastic"):
        ratios = sorted(d / t for d, t in zip(times["ddp"], times[mode]))
        q = len(ratios) // 4
        rate = args.batch_size * args.np / statistics.median(times[mode])
        print(f"{labels[mode]:<55} {rate:>10.0f} {statistics.median(ratios):>7.3f}  {ratios[q]:.3f} to {ratios[-q - 1]:.3f}")


if __name__ == "__main__":
    main()
