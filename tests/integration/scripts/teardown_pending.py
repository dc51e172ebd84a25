"""One rank of a 2-rank gloo world in which rank 0 ends while a collective it abandoned (its
round was left for the next one) ends, failing, on gloo's thread.

    python teardown_pending.py RANK WORKDIR

Rank 0 issues an allreduce that rank 1 never joins, lets go of it as an aborted round's
collectives are let go, enters the next round alone (a reset), and tells rank 1 to exit.
The allreduce then fails ("Connection closed by peer") on gloo's thread. The tensor it
carried frees slowly (its ``__del__`` sleeps 2 s, standing in for the moment in which
torch's own deallocation gives the GIL up): if gloo's thread holds the last reference, the
tensor is freed there, rank 0's script ends meanwhile, the interpreter starts finalizing
(held 3 s by an object its teardown frees), and gloo's thread, back from the sleep inside a
C++ destructor, cannot take the GIL again: "terminate called without an active exception",
exit -6. Rank 0 prints which thread freed
the tensor (if any did before it ended).
"""

import os
import sys
import threading
import time
import types
from pathlib import Path

import torch

rank, workdir = int(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import gloo_world  # noqa: E402


def wait_for(name: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not (workdir / name).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def mark(name: str, text: str = "") -> None:
    (workdir / f"{name}.tmp").write_text(text)
    os.replace(workdir / f"{name}.tmp", workdir / name)


class SlowTeardown:
    """Kept in a module of sys.modules: freed by the interpreter's teardown, after every exit
    handler, and holding that teardown long enough for a sleeping free to wake inside it."""

    def __del__(self, sleep=time.sleep) -> None:
        sleep(3.0)


class SlowToFree(torch.Tensor):
    def __del__(self, mark=mark, sleep=time.sleep, current=threading.current_thread) -> None:
        mark("freeing", current().name)
        sleep(2.0)


torch.set_num_threads(1)
gloo_world.join(rank, 2, workdir / "store0", timeout=60.0)
import elasticrun.torch as hvd  # noqa: E402
from elasticrun.worker import issuing, rounds  # noqa: E402

hvd.allreduce(torch.ones(4), name="together")  # the world works
if rank == 1:
    assert wait_for("go", 60), "rank 0 never said go"
    os._exit(0)  # its sockets close with it: rank 0's pending allreduce fails
# Issued as a gradient bucket is (no agreement of arguments first); rank 1 never joins it.
work = issuing.issue(rounds.current(), lambda g: g.allreduce([torch.ones(1 << 16).as_subclass(SlowToFree)]),
                     "abandoned allreduce")
time.sleep(0.1)
assert not work.is_completed()
del work  # as an aborted round's waits let go of their works
gloo_world.reform(0, 1, workdir / "store1")  # the next round, alone
hvd.allreduce(torch.ones(4), name="alone")
held = types.ModuleType("held_teardown")
held.keeper = SlowTeardown()  # type: ignore[attr-defined]
sys.modules[held.__name__] = held
mark("go")
freed = wait_for("freeing", 3.0)
print("rank 0 done; the abandoned tensor was freed by",
      (workdir / "freeing").read_text() if freed else "no thread yet", flush=True)
