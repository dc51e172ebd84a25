"""What a reset's sync costs the survivors when it sends the model only to the ranks that lack it.

    python benchmarks/sync_receivers.py [--sizes 3,4,6] [--mb 64] [--trials 5]

A real gloo world of N processes (tests/gloo_world.py: FileStore groups, the real runtime and
``TorchState``) holds a model of ``--mb`` MiB with SGD momentum (as much again of optimizer
state). Each trial, in the same run and alternating:

* **join**: ranks 0..N-2 (the survivors) commit a step and are interrupted right after it, as
  a host's arrival does; rank N-1 is a newcomer with a model of its own; everyone syncs.
* **failure**: every rank restores its last commit after a step, as after a peer's death;
  everyone syncs.

``targeted`` is the sync as it is: the model and optimizer state go only to the ranks that do
not hold the newest commit (worker/torch_state.py ``_newest_commit_root``). The baseline,
``everyone``, is the same sync with every rank counted as lacking it: the whole round's
broadcast, as before. Printed: rank 0's sync time (p50 over the trials) of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = str(Path(__file__).resolve())
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import gloo_world  # noqa: E402  (a dev tool: real multi-process gloo worlds without the driver)


def _world(rank: int, size: int, workdir: Path) -> dict[str, list[float]]:
    import elasticrun.torch as hvd
    from elasticrun.worker import state_handlers

    params = (workdir / "params").read_text().split()
    mb, trials = int(params[0]), int(params[1])
    width = 1024
    layers = max(1, round(mb * (1 << 20) / (4 * width * width)))
    torch.manual_seed(rank)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    state = hvd.elastic.TorchState(model, opt, step=0)
    state.sync()
    honest = {cls: cls.holds_commit for cls in (state_handlers.ModelStateHandler, state_handlers.OptimizerStateHandler)}
    out: dict[str, list[float]] = {}
    newcomer = size - 1
    for trial in range(trials):
        for how in ("targeted", "everyone"):
            for cls, method in honest.items():
                cls.holds_commit = method if how == "targeted" else (lambda self: False)  # type: ignore[method-assign]
            for case in ("join", "failure"):
                for p in model.parameters():
                    p.grad = torch.full_like(p, 1e-3)
                opt.step()  # the same update on every rank, as averaged gradients are
                state.save()
                if case == "failure":
                    opt.step()
                    state.restore()
                elif rank == newcomer:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.normal_()  # a model of its own
                    state.__dict__["_synced"] = False
                    state.__dict__["_commit_seq"] = 0
                else:
                    state.mark_committed()  # what the interrupt right after the commit does
                hvd.allreduce(torch.zeros(1), name=f"barrier.{trial}.{how}.{case}")
                start = time.perf_counter()
                state.sync()
                out.setdefault(f"{case}/{how}", []).append((time.perf_counter() - start) * 1000)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="3,4,6", help="world sizes (the last rank is the newcomer)")
    p.add_argument("--mb", type=int, default=64, help="MiB of parameters (as much again of momentum)")
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    print(f"{args.mb} MiB of parameters + {args.mb} MiB of SGD momentum; rank 0's sync, p50 of {args.trials} "
          f"trials, both ways alternating in one run")
    print(f"{'ranks':>5} {'case':<32} {'everyone ms':>12} {'targeted ms':>12} {'ratio':>7}")
    for n in (int(x) for x in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="elasticrun-sync-") as d:
            work = Path(d)
            work.mkdir(exist_ok=True)
            (work / "params").write_text(f"{args.mb} {args.trials}")
            results = gloo_world.run_world(HERE, "_world", n, work, timeout=900, collective_timeout=300)
        root = results[0]
        for case, label in (("join", f"join: {n - 1} survivors + 1 newcomer"),
                            ("failure", f"failure: {n} survivors restored")):
            base = statistics.median(root[f"{case}/everyone"])
            new = statistics.median(root[f"{case}/targeted"])
            print(f"{n:>5} {label:<32} {base:>12.1f} {new:>12.1f} {new / base:>7.2f}")


if __name__ == "__main__":
    main()
