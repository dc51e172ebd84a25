"""Cost of elastic state: ``state.commit()`` against memcpy, and ``check_host_updates()`` per step.

    python benchmarks/commit.py [--sizes 16,128] [--deep-layers 128] [--repeats 20]
                                [--hidden 256] [--layers 2] [--batch-size 64] [--blocks 60] [--block 20]

Runs two jobs one after the other (never concurrently: timings on 2 cores go wrong under load):

  (1) One process, standalone (no launcher: a 1-rank job), torch on 1 thread like a worker of
      a 2-rank job on this machine. For ``hvd.elastic.TorchState(model=MLP, optimizer=...)``
      of 16 and 128 MB of model+optimizer state (SGD with momentum: weights + momentum;
      Adam: weights + exp_avg + exp_avg_sq), interleaved in every round:
        clone     ``torch.clone`` of one tensor of the same bytes (allocates: page faults)
        copy_     ``dst.copy_(src)`` of the same bytes into a pre-allocated tensor (the floor)
        per-tensor ``buf.copy_(t)`` for every state tensor into pre-allocated buffers
        save      ``state.save()``, the copy a commit makes
        watched   the same save while a newcomer's fetch watches the model (worker/prefetch.py):
                  each model tensor compared with its committed copy before it is written;
                  nothing changed here, so every byte is compared (the worst case)
        commit    ``state.commit()`` (save + the host check, a no-op without the launcher)
      Also the same 16 MB spread over ``--deep-layers`` Linear layers (hundreds of tensors,
      like a small CNN or transformer) to show what each tensor costs.
  (2) A real 2-rank job launched by elasticrun (``-np 2 -H localhost:2``), nothing changing
      in the job. Interleaved blocks of ``--block`` calls, median of ``--blocks`` blocks:
        the bare tiny gloo allreduce (float64[2], MAX, blocking ``work.wait()``), the same
        through elasticrun's polled wait, ``state.check_host_updates()`` alone, a bare
        training step (``hvd.DistributedOptimizer``, small MLP; twice, as an A/A control of
        the noise), the step followed by the check, and the step followed by a bare tiny gloo
        allreduce. What a call adds to a step is the median over rounds of the difference to
        the bare-step block of the same round;
      and commit of a 16 MB state inside the 2-rank job (save, commit = save + host check).

Targets (issue 6): commit <= 1.5 x memcpy; check_host_updates() <= 0.2 ms per step with 2 ranks.
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


def build_state(mb: float, optimizer: str, layers: int):
    """An MLP of ``layers`` square Linear layers plus its optimizer, with optimizer state
    allocated (one step taken), sized so that model + optimizer state is about ``mb`` MiB."""
    import torch

    copies = 2 if optimizer == "sgd" else 3  # weights + momentum | weights + exp_avg + exp_avg_sq
    floats = mb * MiB / 4 / copies
    width = max(8, int((floats / layers) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state_tensors(model, opt) -> list:
    import torch

    live = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    live += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return live


def interleaved(fns: dict, rounds: int, warmup: int = 3) -> dict:
    """Time every fn once per round, rotating the order; {name: [seconds, ...]}."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start = time.perf_counter()
            out = fns[name]()
            elapsed = time.perf_counter() - start
            del out  # freeing (e.g. a clone) is not timed
            if r >= warmup:
                times[name].append(elapsed)
    return times


def summary(times: dict, per: int = 1) -> dict:
    """Median and min in ms (``per`` calls per sample)."""
    return {n: {"median_ms": statistics.median(v) * 1e3 / per, "min_ms": min(v) * 1e3 / per}
            for n, v in times.items()}


# --------------------------------------------------------------------------- (1) commit vs memcpy


def run_commit(args) -> None:
    import torch

    import elasticrun.torch as hvd
    from elasticrun.worker.state_handlers import ModelStateHandler

    torch.set_num_threads(args.threads)
    hvd.init()  # standalone: a 1-rank job
    configs = [(mb, opt, args.layers_commit) for mb in args.sizes for opt in ("sgd", "adam")]
    if args.deep_layers:
        configs += [(args.sizes[0], opt, args.deep_layers) for opt in ("sgd", "adam")]
    rows = []
    for mb, optname, layers in configs:
        model, opt = build_state(mb, optname, layers)
        state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)
        live = state_tensors(model, opt)
        bufs = [torch.empty_like(t) for t in live]
        nbytes = sum(t.numel() * t.element_size() for t in live)
        src = torch.rand(nbytes // 4)
        dst = torch.empty_like(src)

        def per_tensor():
            for b, t in zip(bufs, live):
                b.copy_(t)

        models = [h for h in state._handlers.values() if isinstance(h, ModelStateHandler)]

        def watched(models=models, state=state):
            for h in models:
                h.watch(1)
            state.save()
            for h in models:
                h.end_watch()

        fns = {
            "clone": lambda: src.clone(),  # freed after the timer stops
            "copy_": lambda: dst.copy_(src),
            "per_tensor": per_tensor,
            "save": state.save,
            "watched": watched,
            "commit": state.commit,
        }
        rounds = args.repeats if mb <= 32 else max(5, args.repeats // 2)
        rows.append({"mb": nbytes / MiB, "optimizer": optname, "layers": layers, "tensors": len(live),
                     **summary(interleaved(fns, rounds))})
        del model, opt, state, live, bufs, src, dst, models, watched
    print(json.dumps({"commit": rows}), flush=True)


# --------------------------------------------------------------------------- (2) host check, 2 ranks


def run_check(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import elasticrun.torch as hvd
    from elasticrun.worker import collectives, runtime

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    layers, width = [], 64
    for _ in range(args.layers):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.ReLU()]
        width = args.hidden
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    data = torch.randn(args.batch_size, 64)
    target = torch.randint(0, 10, (args.batch_size,))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    big_model, big_opt = build_state(args.commit_mb, "sgd", 4)
    big = hvd.elastic.TorchState(model=big_model, optimizer=big_opt, epoch=0, batch=0)
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(big_model, big_opt))
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    flag = torch.zeros(2, dtype=torch.float64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX

    def step():
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def gloo_allreduce():  # what a check costs at the least: one tiny collective, blocking wait
        runtime.get().pg.allreduce([flag], opts).wait()

    def polled_allreduce():
        collectives.allreduce_inplace(flag, dist.ReduceOp.MAX, "bench")

    def step_check():
        step()
        state.check_host_updates()

    def step_allreduce():
        step()
        gloo_allreduce()

    def block(fn):
        def run():
            for _ in range(args.block):
                fn()
        return run

    @hvd.elastic.run
    def measure(state):
        per_call = {"gloo_allreduce": gloo_allreduce, "polled_allreduce": polled_allreduce,
                    "check": state.check_host_updates, "step": step, "step_again": step,
                    "step_check": step_check, "step_allreduce": step_allreduce}
        # Same order on both ranks (collectives match by issue order): rotation is by round.
        times = interleaved({k: block(f) for k, f in per_call.items()}, args.blocks)
        calls = summary(times, per=args.block)
        # Added cost per step: median over rounds of (this block - the bare-step block of the
        # same round), which cancels slow drifts; "step_again" is the A/A control (noise).
        for k in ("step_again", "step_check", "step_allreduce"):
            calls[k]["added_ms"] = statistics.median(
                (a - b) * 1e3 / args.block for a, b in zip(times[k], times["step"]))
        commits = summary(interleaved({"copy_": lambda: dst.copy_(src), "save": big.save, "commit": big.commit},
                                      args.repeats))
        return calls, commits

    calls, commits = measure(state)
    if hvd.rank() == 0:
        print(json.dumps({"check": calls, "commit2": commits, "commit2_mb": nbytes / MiB}), flush=True)


# --------------------------------------------------------------------------- driver


def verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,128", help="MiB of model+optimizer state for (1)")
    p.add_argument("--deep-layers", type=int, default=128,
                   help="also spread the first size over this many layers (0: skip)")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds per commit measurement")
    p.add_argument("--threads", type=int, default=1, help="torch threads in (1)")
    p.add_argument("--hidden", type=int, default=256, help="(2): width of the trained MLP")
    p.add_argument("--layers", type=int, default=2, help="(2): hidden layers of the trained MLP")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--blocks", type=int, default=60, help="(2): timed blocks per mode")
    p.add_argument("--block", type=int, default=20, help="(2): calls per block")
    p.add_argument("--commit-mb", type=float, default=16, help="(2): state committed inside the 2-rank job")
    p.add_argument("--skip", choices=["commit", "check"], help="skip one of the two jobs")
    p.add_argument("--worker", choices=["commit", "check"], help=argparse.SUPPRESS)
    p.add_argument("--layers-commit", type=int, default=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = [float(s) for s in str(args.sizes).split(",")]

    if args.worker == "commit":
        run_commit(args)
        return
    if args.worker == "check":
        run_check(args)
        return

    common = ["--sizes", ",".join(f"{s:g}" for s in args.sizes), "--deep-layers", str(args.deep_layers),
              "--repeats", str(args.repeats), "--threads", str(args.threads), "--hidden", str(args.hidden),
              "--layers", str(args.layers), "--batch-size", str(args.batch_size), "--blocks", str(args.blocks),
              "--block", str(args.block), "--commit-mb", f"{args.commit_mb:g}"]

    if args.skip != "commit":
        rows = json_result([sys.executable, HERE, "--worker", "commit", *common], '{"commit"')["commit"]
        print(f"(1) commit of hvd.elastic.TorchState(model=MLP, optimizer=...) against memcpy of the same "
              f"bytes; 1 process, {args.threads} torch thread(s); median ms (min) over {args.repeats} "
              f"interleaved rounds")
        head = (f"{'state':<28} {'tensors':>7} {'clone':>14} {'copy_':>14} {'per-tensor':>14} {'save':>14} "
                f"{'watched':>14} {'commit':>14} {'save/copy_':>10} {'commit/copy_':>12} {'commit/clone':>12} "
                f"{'watched/save':>12}")
        print(head)
        for r in rows:
            def cell(k, r=r):
                return f"{r[k]['median_ms']:>6.2f} ({r[k]['min_ms']:>5.2f})"
            label = f"{r['mb']:.0f} MB {'SGD-m' if r['optimizer'] == 'sgd' else 'Adam'}, {r['layers']} layers"
            floor = r["copy_"]["median_ms"]
            print(f"{label:<28} {r['tensors']:>7} {cell('clone')} {cell('copy_')} {cell('per_tensor')} "
                  f"{cell('save')} {cell('watched')} {cell('commit')} {r['save']['median_ms'] / floor:>10.2f} "
                  f"{r['commit']['median_ms'] / floor:>12.2f} "
                  f"{r['commit']['median_ms'] / r['clone']['median_ms']:>12.2f} "
                  f"{r['watched']['median_ms'] / r['save']['median_ms']:>12.2f}")
        for r in rows:
            ratio = r["commit"]["median_ms"] / r["copy_"]["median_ms"]
            print(f"  commit <= 1.5 x copy_, {r['mb']:.0f} MB {r['optimizer']} {r['layers']} layers: "
                  f"{verdict(ratio <= 1.5)} ({ratio:.2f})")

    if args.skip != "check":
        cmd = [sys.executable, "-m", "elasticrun", "-np", "2", "-H", "localhost:2", "--log-level", "WARNING",
               sys.executable, HERE, "--worker", "check", *common]
        res = json_result(cmd, '{"check"')
        c = res["check"]
        base = c["gloo_allreduce"]["median_ms"]
        print(f"\n(2) per-call cost with 2 ranks (elasticrun -np 2 -H localhost:2), nothing changing; "
              f"MLP {args.layers}x{args.hidden}, batch {args.batch_size}; median ms per call (min) over "
              f"{args.blocks} blocks of {args.block}")
        labels = {"gloo_allreduce": "bare tiny gloo allreduce (float64[2], blocking wait)",
                  "polled_allreduce": "same, elasticrun's polled wait",
                  "check": "state.check_host_updates()",
                  "step": "bare training step",
                  "step_again": "bare training step again (A/A control)",
                  "step_check": "step + check_host_updates()",
                  "step_allreduce": "step + bare tiny gloo allreduce"}
        print(f"{'operation':<54} {'ms':>16} {'/ bare allreduce':>17} {'added to the step':>18}")
        for k, label in labels.items():
            added = f"{c[k]['added_ms']:>18.3f}" if "added_ms" in c[k] else ""
            print(f"{label:<54} {c[k]['median_ms']:>7.3f} ({c[k]['min_ms']:>6.3f}) "
                  f"{c[k]['median_ms'] / base:>17.2f} {added}")
        overhead = c["step_check"]["added_ms"]
        print(f"check_host_updates() overhead per step: {overhead:.3f} ms "
              f"({overhead / c['step']['median_ms']:.1%} of the bare step; a bare tiny gloo allreduce adds "
              f"{c['step_allreduce']['added_ms']:.3f}, noise (A/A) {c['step_again']['added_ms']:+.3f}) "
              f"-> <= 0.2 ms: {verdict(overhead <= 0.2)}")
        k = {name: v["median_ms"] for name, v in res["commit2"].items()}
        print(f"commit of a {res['commit2_mb']:.0f} MB state inside the 2-rank job: copy_ {k['copy_']:.2f} ms, "
              f"save {k['save']:.2f} ms, commit {k['commit']:.2f} ms (commit/copy_ {k['commit'] / k['copy_']:.2f}, "
              f"host check inside commit {k['commit'] - k['save']:.3f} ms)")


if __name__ == "__main__":
    main()
