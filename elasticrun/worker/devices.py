"""Which process group carries a tensor, and the NCCL groups of CUDA tensors.

Every round has a gloo group (``Round.pg``): it carries CPU tensors and every agreement the
job makes (host updates, durable-copy requests, the newest commit), whatever the model's
device. CUDA tensors travel over a second, NCCL group bound to this rank's GPU when the round
agreed on it (``Round.device_backend == "nccl"``); otherwise they go through gloo, which
stages them through host memory.

The choice is the driver's, per round, so that every rank of a round makes the same one (a
rank on NCCL and its peer on gloo would wait for each other forever): workers report the GPUs
NCCL could use where they run (their UUIDs) before each rendezvous, and the driver's registry
picks NCCL when ``--backend`` allows it and no two workers of the round would share a GPU (NCCL
refuses two ranks on one GPU: more workers than GPUs, or two "hosts" that are one machine).
See ``registry.device_backend``. A worker's GPU is its slot's (``slot % GPUs``: its local rank
whenever its host's slots are all in use), unless the script chose one before ``hvd.init()``;
it never changes for the life of the process.

The NCCL group of a round is formed on the round's store: at the rendezvous with ``--backend
nccl``, or at the round's first collective on a CUDA tensor with ``auto`` (which every rank
reaches at the same point; a CPU job never creates a CUDA context). It is then connected at
once (``eager_connect_single_device``). When a round ends badly (the driver's abort, a peer's
death, the collective timeout) its NCCL communicator is aborted on a thread of its own:
``abort()`` takes about a second and unblocks a kernel stuck on a dead peer, and the survivor
goes on to the next round meanwhile. Nothing here initializes CUDA at import: a warm-start
template imports this module and must fork with CUDA untouched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticrun.common import env

log = logging.getLogger("elasticrun.worker")

__all__ = ["BACKENDS", "requested", "nccl_gpus", "rank_device", "new_nccl", "connect", "abort_soon",
           "settle_aborts", "is_device_tensor"]

BACKENDS = ("auto", "gloo", "nccl")

#: What the NCCL process groups need from torch's NCCL watchdog, unless the user set it: on
#: an error, abort the communicator and fail the work (2: CleanUpOnly), never kill the process
#: (torch's default tears it down: a survivor must live on); no heartbeat monitor that aborts a
#: process whose watchdog waits on an abort; no trace dumps at a timeout.
_NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0",
                     "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_BLOCKING_WAIT": "0"}
#: torch's own NCCL timeout, beyond the collective timeout: elasticrun's wait gives up first.
_WATCHDOG_SLACK = 30.0


def requested() -> str:
    """The job's ``--backend`` (``ELASTICRUN_BACKEND``): auto, gloo or nccl."""
    value = os.environ.get(env.BACKEND, "auto").strip().lower()
    return value if value in BACKENDS else "auto"


def nccl_gpus() -> list[str]:
    """The GPUs NCCL could use in this process, in device order, by a name that is the same for
    every process seeing that GPU (its UUID): [] without NCCL in this torch, or without a GPU.
    Initializes the CUDA driver where there is one: workers call it, templates never."""
    if requested() == "gloo" or not dist.is_available() or not dist.is_nccl_available():
        return []
    try:
        if not torch.cuda.is_available():
            return []
        return [gpu_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver is "no GPU" here; the job runs on gloo
        return []


def gpu_name(index: int) -> str:
    """GPU ``index``'s name for the driver: the same for every process that sees that GPU."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid:
        return str(uuid)
    try:  # an older torch: this machine and the device's PCI address
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            machine = f.read().strip()
    except OSError:
        machine = os.uname().nodename
    return f"{machine}/{getattr(props, 'pci_bus_id', index)}:{getattr(props, 'pci_device_id', '')}"


def rank_device(slot: int) -> torch.device:
    """This worker's GPU: the one the script chose (it set a device before elasticrun formed a
    NCCL group), else its slot's (``slot % GPUs``), as the driver assumed when it chose NCCL."""
    if torch.cuda.is_initialized() and torch.cuda.current_device() != 0:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    return torch.device("cuda", slot % count if count else 0)


def is_device_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` travels over the round's device group (when it has one)."""
    return t.is_cuda


#: The GPU this process's NCCL groups are on, once one was formed (it never changes after).
bound: torch.device | None = None


def kind_device(kind: str) -> torch.device:
    """Where to make a tensor for an operation whose tensors were of ``kind`` ("cuda": this
    rank's GPU; anything else: the CPU). A rank in ``join()`` mirrors the others with it.
    The GPU its groups are bound to, not this thread's current device: the group may have
    been formed (and set_device called) on another thread, autograd's, and a script that
    places its tensors with ``.to("cuda:1")`` leaves the main thread's current device at 0."""
    if kind != "cuda":
        return torch.device("cpu")
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def new_nccl(store: Any, rank: int, size: int, timeout: float) -> Any:
    """A NCCL group of ``size`` ranks on ``store`` (a prefix of the round's), not connected yet:
    the caller registers it (so that an abort can reach it) before :func:`connect`."""
    for name, value in _NCCL_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout + _WATCHDOG_SLACK)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def connect(pg: Any, device: torch.device) -> None:
    """Create ``pg``'s communicator on ``device`` now (NCCL's eager init), not at its first
    collective. Raises what NCCL raises (a peer that never came, a refused device, an abort)."""
    torch.cuda.set_device(device)
    eager = getattr(pg, "eager_connect_single_device", None)
    if eager is not None:
        eager(device)
    else:  # an older torch: a first collective connects
        pg.allreduce([torch.zeros(1, device=device)]).wait()
        torch.cuda.current_stream(device).synchronize()


_aborting: list[threading.Thread] = []
_abort_lock = threading.Lock()


def abort_soon(pg: Any, why: str = "") -> None:
    """Abort a NCCL group's communicators on a thread of their own (about a second, measured):
    a kernel stuck on a dead peer ends, and the caller never waits for it."""
    if pg is None:
        return
    abort = getattr(pg, "abort", None) or getattr(pg, "_abort", None) or getattr(pg, "shutdown", None)
    if abort is None:
        return

    def run() -> None:
        started = time.monotonic()
        try:
            abort()
        except Exception as exc:  # already aborted, or torch aborted it for its error
            log.debug("aborting a NCCL group (%s): %s", why, exc)
        log.debug("NCCL group aborted in %.2f s (%s)", time.monotonic() - started, why)

    thread = threading.Thread(target=run, name="elasticrun-nccl-abort", daemon=True)
    with _abort_lock:
        _aborting[:] = [t for t in _aborting if t.is_alive()]
        _aborting.append(thread)
    thread.start()


def settle_aborts(timeout: float = 5.0) -> None:
    """At exit: wait for aborts under way (an abort cut off by the interpreter's end, inside
    NCCL, would end the process with std::terminate)."""
    deadline = time.monotonic() + timeout
    with _abort_lock:
        pending, _aborting[:] = list(_aborting), []
    for t in pending:
        t.join(max(0.0, deadline - time.monotonic()))
