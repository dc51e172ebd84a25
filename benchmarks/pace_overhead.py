"""What measuring each step for the straggler check (issue 16) adds to a training step.

    python benchmarks/pace_overhead.py [--steps 1000] [--repeats 30]

Per step the training thread now takes two ``time.perf_counter()`` readings around the
optimizer's ``synchronize()`` and records them (``Runtime.step_done`` -> ``StepPace.record``:
two stores into fixed rings). This prints:

  (1) that work alone, per step, in ns (timeit over 10^6 steps);
  (2) a whole ``hvd.DistributedOptimizer`` step of a tiny model (Linear 8->2, batch 6, one
      process: elasticrun's standalone world, where the step does no communication, so the
      bookkeeping is the largest share it can be), with the recording as shipped against the
      runtime's StepPace replaced by a no-op (the two clock readings stay), in --repeats pairs
      of runs in alternating order; the median of the pairs' ratios, as steps/s on / off.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit


def per_step_ns() -> float:
    from elasticrun.worker.pace import StepPace

    p = StepPace()
    p.new_round(0)
    clock = time.perf_counter

    def one() -> None:  # what step() and step_done() add: two readings and the record
        started = clock()
        wait = clock() - started
        p.record(clock(), wait)

    n = 1_000_000
    return min(timeit.repeat(one, number=n, repeat=5)) / n * 1e9


def step_us(args) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd
    from elasticrun.worker import runtime

    torch.set_num_threads(1)
    hvd.init()
    rt = runtime.get()
    model = torch.nn.Linear(8, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(6, 8), torch.randint(0, 2, (6,))
    class NoPace:
        def record(self, now: float, wait: float) -> None:
            pass

    real, noop = rt.pace, NoPace()

    def run(pace) -> float:
        rt.pace = pace
        for _ in range(20):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - start) / args.steps * 1e6

    # Pairs in alternating order (on-off, off-on, ...): a drift of the machine (other processes,
    # frequency) hits both sides alike; the ratio of each pair is taken, then their median.
    shipped, without, ratios = [], [], []
    for i in range(args.repeats):
        if i % 2 == 0:
            a = run(real)
            b = run(noop)
        else:
            b = run(noop)
            a = run(real)
        shipped.append(a)
        without.append(b)
        ratios.append(a / b)
    rt.pace = real
    ratios.sort()
    q = len(ratios) // 4
    return statistics.median(shipped), statistics.median(without), statistics.median(ratios), (ratios[q], ratios[-q - 1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000, help="steps per run")
    p.add_argument("--repeats", type=int, default=30, help="pairs of runs (recording on, off)")
    args = p.parse_args()
    print(f"(1) perf_counter x2 + StepPace.record: {per_step_ns():.0f} ns per step")
    shipped, without, ratio, (low, high) = step_us(args)
    print(f"(2) tiny-model step, 1 process, median of {args.repeats} pairs of {args.steps} steps: {shipped:.1f} us "
          f"with the recording, {without:.1f} us without; steps/s on/off = {1 / ratio:.3f} "
          f"(middle half of the pairs: {1 / high:.3f} to {1 / low:.3f})")


if __name__ == "__main__":
    main()
