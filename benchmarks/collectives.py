"""The Horovod-parity collectives against the same operation in raw ``torch.distributed`` (gloo).

    python benchmarks/collectives.py [--elements 262144] [--repeats 40] [--calls 5] [--only alltoall,...]

Two processes on this machine (2 ranks), each with two gloo groups formed on one FileStore:
elasticrun's round (``hvd.*``, polled and abortable) and a raw default group
(``torch.distributed.*``, blocking waits). For every row, ``--calls`` calls of ours and
``--calls`` of raw alternate ``--repeats`` times, which one goes first alternating too. The
times are medians per call; the ratio is the median of the repeats' own ratios (ours / raw
measured side by side, which cancels this VM's drift over seconds), with the middle half of
those ratios beside it. Target: ratio <= 1.2.

The raw side does what a user of ``torch.distributed`` would write for the same result:

  grouped_allreduce   16 tensors: flatten, one all_reduce, copy back
  allgather           all_gather_into_tensor (equal first dimensions: raw cannot do unequal ones)
  broadcast_async     broadcast(async_op=True).wait()
  alltoall(splits)    all_to_all_single of the splits, then of the rows: Horovod's alltoall returns
                      the received splits, which the receiver does not know beforehand. A second
                      row gives raw the received splits for free (not the same operation: a
                      lower bound no implementation of Horovod's alltoall can reach)
  reducescatter       reduce_scatter_tensor (Sum)
  grouped_allgather   all_gather_into_tensor of each of 4 tensors
  grouped_reducescatter  reduce_scatter_tensor of each of 4 tensors
  sparse_allreduce    all_gather of the indices and of the values (nnz equal on both ranks)
  Adasum              all_gather of both vectors, then the same combination locally
  process set allreduce  all_reduce on a new_group of both ranks
  SyncBatchNorm fwd+bwd  an autograd Function with the same math as hvd.SyncBatchNorm (statistics
                      through all_gather, gradient sums through all_reduce, running statistics,
                      affine, input gradient): torch.nn.SyncBatchNorm refuses CPU tensors
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, size: int, store_path: str, args: argparse.Namespace, out: str) -> None:
    for name in list(os.environ):
        if name.startswith("ELASTICRUN_"):
            del os.environ[name]
    torch.set_num_threads(1)
    import elasticrun.torch as hvd
    from elasticrun.worker import adasum, runtime

    rt = runtime.init()
    store = dist.FileStore(store_path, size)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("elasticrun", store), rank, size, timedelta(seconds=60))
    rt.enter_round(1, rank, size, pg, dist.PrefixStore("elasticrun-store", store))
    dist.init_process_group("gloo", store=dist.PrefixStore("raw", store), rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    raw_pair = dist.new_group([0, 1])
    pair = hvd.add_process_set([0, 1])

    n = args.elements
    x = torch.randn(n)
    parts = [torch.randn(n // 16) for _ in range(16)]
    fours = [torch.randn(n // 4) for _ in range(4)]
    nnz = max(1, n // 64)
    sparse = torch.sparse_coo_tensor(torch.randint(0, n, (1, nnz)), torch.randn(nnz), (n,))
    splits = [n // 4, n - n // 4] if rank == 0 else [n - n // 4, n // 4]
    recv = [[n // 4, n - n // 4], [n - n // 4, n // 4]]  # [sender][receiver]
    my_recv = [recv[0][rank], recv[1][rank]]
    bn_x = torch.randn(64, 32, 8, 8)
    bn = hvd.SyncBatchNorm(32)

    def raw_grouped() -> None:
        flat = torch.cat(parts)
        dist.all_reduce(flat)
        off = 0
        for p in parts:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()

    def raw_allgather() -> None:
        outp = torch.empty(size * n)
        dist.all_gather_into_tensor(outp, x)

    send_splits = torch.tensor(splits, dtype=torch.int64)

    def raw_alltoall() -> None:  # the same operation: the receiver learns the splits, then the rows
        recv_splits = torch.empty(size, dtype=torch.int64)
        dist.all_to_all_single(recv_splits, send_splits)
        counts = recv_splits.tolist()
        outp = torch.empty(sum(counts))
        dist.all_to_all_single(outp, x, counts, splits)

    def raw_alltoall_told() -> None:  # not the same operation: the caller already knows what arrives
        outp = torch.empty(sum(my_recv))
        dist.all_to_all_single(outp, x, my_recv, splits)

    def raw_reducescatter() -> None:
        outp = torch.empty(n // size)
        dist.reduce_scatter_tensor(outp, x)

    def raw_grouped_allgather() -> None:
        for t in fours:
            dist.all_gather_into_tensor(torch.empty(size * t.numel()), t)

    def raw_grouped_reducescatter() -> None:
        for t in fours:
            dist.reduce_scatter_tensor(torch.empty(t.numel() // size), t)

    def raw_sparse() -> None:
        idx, val = sparse._indices().t().contiguous(), sparse._values()
        gi = [torch.empty_like(idx) for _ in range(size)]
        gv = [torch.empty_like(val) for _ in range(size)]
        dist.all_gather(gi, idx)
        dist.all_gather(gv, val)
        torch.sparse_coo_tensor(torch.cat(gi).t(), torch.cat(gv), sparse.size())

    def raw_adasum() -> None:
        g = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(g, x)
        adasum.combine(g[0], g[1], [(0, n)])

    class RawSyncBN(torch.autograd.Function):
        """What a torch.distributed user writes for a CPU SyncBatchNorm: the same math as
        hvd.SyncBatchNorm (Chan's combination in float64, running statistics, affine, the
        input gradient of the global normalization), with raw all_gather / all_reduce."""

        @staticmethod
        def forward(ctx: Any, xx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            c = xx.shape[1]
            dims = [0, 2, 3]
            count = xx.numel() // c
            mean = xx.mean(dims)
            m2 = ((xx - mean.view(1, c, 1, 1)) ** 2).sum(dims)
            stats = torch.cat([mean.new_full((1,), float(count)), mean, m2]).double()
            g = [torch.empty_like(stats) for _ in range(size)]
            dist.all_gather(g, stats)
            gathered = torch.stack(g)
            counts, means, m2s = gathered[:, 0], gathered[:, 1:c + 1], gathered[:, c + 1:]
            total = counts.sum()
            g_mean = (counts[:, None] * means).sum(0) / total
            g_m2 = (m2s + counts[:, None] * (means - g_mean) ** 2).sum(0)
            with torch.no_grad():
                raw_running[0].mul_(0.9).add_(g_mean.float(), alpha=0.1)
                raw_running[1].mul_(0.9).add_((g_m2 / (total - 1)).float(), alpha=0.1)
            invstd = torch.rsqrt(g_m2 / total + 1e-5).float()
            xhat = (xx - g_mean.float().view(1, c, 1, 1)) * invstd.view(1, c, 1, 1)
            ctx.save_for_backward(xhat, invstd, weight)
            ctx.total = float(total)
            return xhat * weight.view(1, c, 1, 1) + bias.view(1, c, 1, 1)

        @staticmethod
        def backward(ctx: Any, dy: torch.Tensor) -> Any:
            xhat, invstd, weight = ctx.saved_tensors
            c = xhat.shape[1]
            dims = [0, 2, 3]
            sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
            sums = torch.cat([sum_dy, sum_dy_xhat]).double()
            dist.all_reduce(sums)
            g_dy, g_dy_xhat = sums[:c].float().view(1, c, 1, 1), sums[c:].float().view(1, c, 1, 1)
            dx = (dy - (g_dy + xhat * g_dy_xhat) / ctx.total) * invstd.view(1, c, 1, 1) * weight.view(1, c, 1, 1)
            return dx, sum_dy_xhat, sum_dy

    raw_running = (torch.zeros(32), torch.ones(32))
    raw_weight, raw_bias = torch.ones(32, requires_grad=True), torch.zeros(32, requires_grad=True)

    def raw_sync_bn() -> None:
        xx = bn_x.clone().requires_grad_()
        RawSyncBN.apply(xx, raw_weight, raw_bias).sum().backward()

    def ours_sync_bn() -> None:
        xx = bn_x.clone().requires_grad_()
        bn(xx).sum().backward()

    rows: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("grouped_allreduce (16 tensors)", lambda: hvd.grouped_allreduce_(parts, op=hvd.Sum), raw_grouped),
        ("allgather", lambda: hvd.allgather(x), raw_allgather),
        ("broadcast_async", lambda: hvd.synchronize(hvd.broadcast_async_(x, 0)),
         lambda: dist.broadcast(x, 0, async_op=True).wait()),
        ("alltoall (splits)", lambda: hvd.alltoall(x, splits=splits), raw_alltoall),
        ("alltoall (splits), raw told the received splits", lambda: hvd.alltoall(x, splits=splits),
         raw_alltoall_told),
        ("reducescatter", lambda: hvd.reducescatter(x, op=hvd.Sum), raw_reducescatter),
        ("grouped_allgather (4 tensors)", lambda: hvd.grouped_allgather(fours), raw_grouped_allgather),
        ("grouped_reducescatter (4 tensors)", lambda: hvd.grouped_reducescatter(fours, op=hvd.Sum),
         raw_grouped_reducescatter),
        ("sparse_allreduce_async", lambda: hvd.sparse_allreduce_async(sparse, "s", hvd.Sum)(), raw_sparse),
        ("allreduce op=Adasum", lambda: hvd.allreduce(x, op=hvd.Adasum), raw_adasum),
        ("allreduce, process set", lambda: hvd.allreduce_(x, op=hvd.Sum, process_set=pair),
         lambda: dist.all_reduce(x, group=raw_pair)),
        ("SyncBatchNorm fwd+bwd (64x32x8x8)", ours_sync_bn, raw_sync_bn),
    ]
    if args.only:
        rows = [row for row in rows if any(word in row[0] for word in args.only.split(","))]
    results = []
    for name, ours, raw in rows:
        for f in (ours, raw):  # warm up: group formation, allocator
            f()
            f()
        times: dict[str, list[float]] = {"ours": [], "raw": []}
        for rep in range(args.repeats):
            # alternate which goes first, so neither always follows the other's leftovers
            order = (("ours", ours), ("raw", raw)) if rep % 2 == 0 else (("raw", raw), ("ours", ours))
            for label, f in order:
                hvd.barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    f()
                times[label].append((time.perf_counter() - start) / args.calls)
        # each repeat's ours and raw ran next to each other: their ratio cancels the VM's drift
        ratios = sorted(o / w for o, w in zip(times["ours"], times["raw"]))
        quarter = len(ratios) // 4
        results.append((name, statistics.median(times["ours"]), statistics.median(times["raw"]),
                        statistics.median(ratios), ratios[quarter], ratios[-1 - quarter]))
    if rank == 0:
        with open(out, "w") as fh:
            for row in results:
                fh.write("\t".join(str(v) for v in row) + "\n")
    hvd.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=262144, help="float32 elements per tensor (default 1 MiB)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--only", default="", help="run only the rows whose name contains one of these comma-separated "
                                              "words (e.g. alltoall,SyncBatchNorm)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.tsv")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, 2, str(Path(tmp) / "store"), args, out)) for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
            if proc.is_alive():
                proc.kill()
        if any(proc.exitcode != 0 for proc in procs):
            print(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}", file=sys.stderr)
            return 1
        lines = Path(out).read_text().splitlines()
    print(f"2 ranks, {args.elements * 4 / 2**20:g} MiB float32 tensors, {args.repeats} repeats of {args.calls} "
          f"calls each, ours and raw side by side\n")
    print("| collective | elasticrun (ms) | raw torch.distributed (ms) | ratio | middle half of the ratios |")
    print("| --- | ---: | ---: | ---: | --- |")
    for line in lines:
        name, ours, raw, ratio, low, high = line.split("\t")
        print(f"| {name} | {float(ours) * 1e3:.3f} | {float(raw) * 1e3:.3f} | {float(ratio):.2f} | "
              f"{float(low):.2f} to {float(high):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
