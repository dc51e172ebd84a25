"""A worker that says how it started: forked warm from a template (torch already imported when
its first line runs) or as a new process, and what a fresh ``python script.py`` would show.

    python warm_probe.py OUT_DIR [--hold SECONDS] [--exit CODE]

Each rank writes OUT_DIR/rank-N.json after one allreduce with the others.
"""

import sys

WARM = "torch" in sys.modules  # a new interpreter has imported nothing of torch yet

import json
import os
import random
import time


def main() -> None:
    import numpy
    import torch

    import elasticrun.torch as hvd

    out_dir = sys.argv[1]
    hold = float(sys.argv[sys.argv.index("--hold") + 1]) if "--hold" in sys.argv else 0.0
    code = int(sys.argv[sys.argv.index("--exit") + 1]) if "--exit" in sys.argv else 0
    hvd.init()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    info = {"warm": WARM, "rank": hvd.rank(), "size": hvd.size(), "total": total, "argv": sys.argv,
            "cwd": os.getcwd(), "pid": os.getpid(), "env_rank": os.environ.get("ELASTICRUN_RANK"),
            "python_random": random.random(), "torch_random": torch.rand(1).item(),
            "numpy_random": float(numpy.random.rand()),
            "threads_at_start": THREADS_AT_START}
    with open(os.path.join(out_dir, f"rank-{hvd.rank()}.json"), "w") as f:
        json.dump(info, f)
    print(f"probe rank {hvd.rank()} warm={WARM}", flush=True)
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(code)


THREADS_AT_START = len(os.listdir("/proc/self/task"))

if __name__ == "__main__":
    main()
