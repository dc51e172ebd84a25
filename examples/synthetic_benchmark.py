"""Elastic synthetic benchmark: training throughput of an MLP on random data.

The elastic counterpart of Horovod's ``pytorch_synthetic_benchmark.py``: a model sized by
flags, random inputs, ``hvd.DistributedOptimizer``; after warm-up batches every iteration
times ``--num-batches-per-iter`` training steps and prints the samples/s of one rank and
of all ranks together. Workers may come and go between iterations: the results so far are
part of the committed state, and every (re)start warms up again (new process group).

    elasticrun -np 2 -H localhost:1,127.0.0.1:1 python examples/synthetic_benchmark.py
    elasticrun -np 2 --min-np 1 --max-np 3 --host-discovery-script examples/discover_hosts.sh \\
        python examples/synthetic_benchmark.py --num-iters 30
    python examples/synthetic_benchmark.py            # one process, no launcher
"""

import argparse
import statistics
import timeit

import torch
import torch.nn.functional as F

import elasticrun.torch as hvd

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--input-dim", type=int, default=1024, help="features per sample")
parser.add_argument("--hidden", type=int, default=1024, help="width of each hidden layer")
parser.add_argument("--layers", type=int, default=4, help="number of hidden layers")
parser.add_argument("--num-classes", type=int, default=10, help="output classes")
parser.add_argument("--batch-size", type=int, default=64, help="batch size per worker")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate of one worker (scaled by the world size)")
parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="untimed batches after every (re)start")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches timed per iteration")
parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(args.threads)
torch.manual_seed(1234)


def log(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


layers: list[torch.nn.Module] = []
width = args.input_dim
for _ in range(args.layers):
    layers += [torch.nn.Linear(width, args.hidden), torch.nn.ReLU()]
    width = args.hidden
layers.append(torch.nn.Linear(width, args.num_classes))
model = torch.nn.Sequential(*layers)

optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)

# Random data, generated once: the benchmark measures compute plus communication.
data = torch.randn(args.batch_size, args.input_dim)
target = torch.randint(0, args.num_classes, (args.batch_size,))


def benchmark_step() -> None:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def on_state_reset() -> None:
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()


n_params = sum(p.numel() for p in model.parameters())
log(f"Model: MLP {args.input_dim} -> {args.layers} x {args.hidden} -> {args.num_classes} "
    f"({n_params / 1e6:.2f} M parameters)")
log(f"Batch size: {args.batch_size} per worker; fp16 allreduce: {args.fp16_allreduce}")


@hvd.elastic.run
def run_benchmark(state) -> None:
    # Every (re)start: a new process group (and maybe new workers), so warm up again.
    log(f"Running warmup on {hvd.size()} worker(s)...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    if state.iter == 0:
        log("Running benchmark...")
    while state.iter < args.num_iters:
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        per_rank = args.batch_size * args.num_batches_per_iter / seconds
        # Sum over the ranks: the job's throughput in this iteration.
        total = hvd.allreduce(torch.tensor([per_rank], dtype=torch.float64), op=hvd.Sum,
                              name="benchmark.total").item()
        log(f"Iter #{state.iter}: {per_rank:.1f} samples/sec per rank, {total:.1f} total "
            f"on {hvd.size()} rank(s)")
        state.results.append((hvd.size(), per_rank, total))
        state.iter += 1
        state.commit()


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, iter=0, results=[])
state.register_reset_callbacks([on_state_reset])
run_benchmark(state)


def mean_conf(values: list[float]) -> str:
    mean = statistics.fmean(values)
    conf = 1.96 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.1f} +-{conf:.1f}"


if hvd.rank() == 0:
    per_rank = [r for _, r, _ in state.results]
    print(f"Samples/sec per rank: {mean_conf(per_rank)}", flush=True)
    for size in sorted({s for s, _, _ in state.results}):
        totals = [t for s, _, t in state.results if s == size]
        print(f"Total samples/sec on {size} rank(s): {mean_conf(totals)} ({len(totals)} iteration(s))",
              flush=True)
