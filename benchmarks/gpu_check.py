"""The GPU check: what a one-GPU machine can prove about elasticrun on CUDA, in one table.

    python benchmarks/gpu_check.py [--quick] [--json FILE]
    python benchmarks/gpu_check.py --device cpu --quick     # the same script, CPU tensors (a smoke run)

Runs in about 4 minutes on one H100/H200 (each part is bounded; ``--quick`` shrinks the sizes).
NCCL refuses two ranks on one GPU, so on one GPU NCCL is exercised at world size 1 and the
2-rank jobs run their CUDA tensors over gloo (the driver chooses so itself: both "hosts" see
the same GPU). Rows:

* **paths, 2 ranks, gloo** / **paths, 1 rank, NCCL**: a real ``elasticrun`` job whose worker
  runs every path that touches tensors on CUDA tensors and compares each with the result it
  must give (computed on the CPU): every allreduce op, fp16 compression, pre/postscale,
  allgather, broadcast, alltoall, reducescatter, the grouped and sparse forms, Adasum, a
  process set, ``join``, ``DistributedOptimizer`` (fp16 compression, ``backward_passes_per_step``),
  ``SyncBatchNorm``, ``broadcast_parameters/optimizer_state/object``, ``TorchState`` commit and
  restore (the committed copy kept on the GPU), the ``ElasticSampler``, and a durable copy
  written from the GPU and resumed onto it by a second run of the same command.
* **kill -9, 2 ranks, gloo**: a 2-rank elastic job on the GPU loses a rank; kill -> next step, and
  when the survivor detected it, the driver decided and the first step ran (the event log).
* **NCCL build/allreduce/abort x20**: build a group, a 4 MB allreduce, abort (never waited on);
  build time, allreduce time, what the abort call costs the caller, and GPU memory and threads
  after the 1st and the 20th.
* **50 resets, NCCL**: a 1-rank ``--backend nccl`` job reset 50 times (a new round and NCCL
  group each time): allocated and reserved memory and threads after the 1st and the 50th.
* **commit / background / restore**: ``TorchState`` of a model + Adam of about 3.2 GB (``--quick``:
  0.4 GB; 0.1 GB with ``--device cpu``) against a raw device-to-device copy of the same tensors: ``commit()`` (goal <= 2x),
  the step after a background commit against a step without (goal <= 1.1x), ``restore()``
  (goal <= 2x).
* **launch -> first step**: ``elasticrun -np 1 python w.py`` to the worker's first CUDA
  allreduce (goal <= 3 s), with and without warm start.

Every row says its goal and whether it was met; the exit status is 0 when every correctness
row passed (timings are reported, not enforced: the machine decides them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
MARK = "GPU-CHECK "
if REPO not in sys.path:  # the commit row runs in this process: the checkout, installed or not
    sys.path.insert(0, REPO)


def _emit(obj: Any) -> None:
    print(MARK + json.dumps(obj), flush=True)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# =============================================================================== the workers
def worker_paths(device: str, log_dir: str) -> None:
    """Every path that touches tensors, on ``device``; one JSON line of results per rank."""
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd
    from elasticrun.worker import runtime

    hvd.init()
    dev = torch.device(device, hvd.local_rank() % max(1, torch.cuda.device_count())) if device == "cuda" \
        else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    r, n = hvd.rank(), hvd.size()
    res: dict[str, Any] = {}

    def check(name: str, fn: Callable[[], bool]) -> None:
        try:
            res[name] = bool(fn())
        except Exception as exc:  # a failed path is a row, not the end of the check
            res[name] = f"{type(exc).__name__}: {str(exc)[:200]}"

    def val(k: int) -> torch.Tensor:
        return torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * k + 1

    x = val(r).to(dev)
    every = [val(k) for k in range(n)]

    def same(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
        return a.device.type == dev.type and torch.allclose(a.float().cpu(), b.float().cpu(), rtol=tol, atol=tol)

    check("allreduce Sum", lambda: same(hvd.allreduce(x, op=hvd.Sum), sum(every)))
    check("allreduce Average", lambda: same(hvd.allreduce(x), sum(every) / n))
    check("allreduce Min", lambda: same(hvd.allreduce(x, op=hvd.Min), torch.stack(every).min(0).values))
    check("allreduce Max", lambda: same(hvd.allreduce(x, op=hvd.Max), torch.stack(every).max(0).values))
    check("allreduce Product", lambda: same(hvd.allreduce(x, op=hvd.Product), torch.stack(every).prod(0), 1e-4))
    check("allreduce fp16", lambda: same(hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16),
                                         sum(every), 1e-2))
    check("allreduce pre/postscale", lambda: same(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                                                postscale_factor=0.5), sum(every)))
    check("allreduce int", lambda: same(hvd.allreduce(torch.tensor([r + 1], device=dev), op=hvd.Sum),
                                        torch.tensor([n * (n + 1) // 2])))
    check("grouped allreduce", lambda: all(same(a, b) for a, b in zip(
        hvd.grouped_allreduce([x, x * 2], op=hvd.Sum), [sum(every), 2 * sum(every)])))
    rows = torch.full((1 + r, 2), float(r), device=dev)
    check("allgather", lambda: same(hvd.allgather(rows), torch.cat([torch.full((1 + k, 2), float(k))
                                                                    for k in range(n)])))
    check("grouped allgather", lambda: same(hvd.grouped_allgather([rows, rows + 1])[1],
                                            torch.cat([torch.full((1 + k, 2), float(k) + 1) for k in range(n)])))
    check("broadcast", lambda: same(hvd.broadcast(x, root_rank=n - 1), every[n - 1]))
    a2a = torch.arange(2 * n, dtype=torch.float32, device=dev) + 100 * r
    check("alltoall", lambda: same(hvd.alltoall(a2a),
                                   torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * k
                                              for k in range(n)])))
    check("reducescatter", lambda: same(hvd.reducescatter(torch.ones(2 * n, 3, device=dev) * (r + 1), op=hvd.Sum),
                                        torch.full((2, 3), float(n * (n + 1) // 2))))
    check("grouped reducescatter", lambda: same(hvd.grouped_reducescatter(
        [torch.ones(2 * n, 3, device=dev)], op=hvd.Sum)[0], torch.full((2, 3), float(n))))
    sparse = torch.sparse_coo_tensor([[r % 3]], torch.tensor([1.0 + r], device=dev), (3,))
    check("sparse allreduce", lambda: same(hvd.sparse_allreduce_async(sparse, name="s", op=hvd.Sum)()
                                           .coalesce().to_dense(),
                                           sum(torch.sparse_coo_tensor([[k % 3]], torch.tensor([1.0 + k]), (3,))
                                               .to_dense() for k in range(n))))
    check("adasum", lambda: bool(torch.isfinite(hvd.allreduce(x, op=hvd.Adasum)).all()))
    ps = hvd.add_process_set(list(range(n))) if n > 1 else None
    check("process set", lambda: same(hvd.allreduce(x, op=hvd.Sum, process_set=ps), sum(every)) if ps else True)
    check("allgather_object", lambda: hvd.allgather_object(r) == list(range(n)))
    check("broadcast_object", lambda: hvd.broadcast_object({"from": r}, root_rank=0) == {"from": 0})

    torch.manual_seed(1 + r)  # different on each rank: the broadcasts must make them equal
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), hvd.SyncBatchNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2)).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16, backward_passes_per_step=2)

    def params_equal() -> bool:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = hvd.allgather(flat.unsqueeze(0))
        return bool(torch.allclose(gathered.float(), gathered[:1].float().expand_as(gathered)))

    check("broadcast_parameters", lambda: (hvd.broadcast_parameters(model.state_dict(), root_rank=0),
                                           params_equal())[1])
    big = {"w": torch.full((1024, 600), float(r), device=dev), "h": torch.full((600, 1024), float(r), device=dev,
                                                                           dtype=torch.float16).t()}
    check("broadcast_parameters, tensors >= 1 MiB (in place)", lambda: (
        hvd.broadcast_parameters(big, root_rank=n - 1),
        bool((big["w"] == n - 1).all()) and bool((big["h"] == n - 1).all()) and big["w"].device.type == dev.type)[1])
    data = torch.randn(16, 8, device=dev) + r
    target = torch.randint(0, 2, (16,), device=dev)
    for _ in range(2):  # backward_passes_per_step=2: one step from two passes
        F.cross_entropy(model(data), target).backward()
    check("DistributedOptimizer fp16, 2 passes/step", lambda: (opt.step(), opt.zero_grad(), params_equal())[2])
    check("broadcast_optimizer_state", lambda: (hvd.broadcast_optimizer_state(opt, root_rank=0), True)[1])
    check("SyncBatchNorm running stats equal", lambda: bool(torch.allclose(
        hvd.allgather(model[1].running_mean.unsqueeze(0)).float(),
        model[1].running_mean.unsqueeze(0).float().expand(n, -1), atol=1e-5)))

    dataset = list(range(40))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    def commit_restore() -> bool:
        state.commit()
        kept = state._handlers["model"]._buffers
        on_device = all(b.device.type == dev.type for b in kept.values())
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        state.restore()
        return on_device and all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))

    check("TorchState commit/restore (copy on the device)", commit_restore)
    check("ElasticSampler", lambda: sorted(sum(hvd.allgather_object(list(sampler)), [])) == dataset)
    res["backend"] = runtime.get().current_round.device_backend
    res["rank"] = r

    entered: list[int] = []

    @hvd.elastic.run
    def train(state: Any) -> None:
        entered.append(state.epoch)  # after a resume from a durable copy: where it resumed
        while state.epoch < 6:  # durable copies from the GPU (with --checkpoint-dir)
            F.cross_entropy(model(data), target).backward()
            F.cross_entropy(model(data), target).backward()
            opt.step()
            opt.zero_grad()
            state.epoch += 1
            state.commit()
            time.sleep(0.3)

    train(state)
    res["first_epoch"] = entered[0]
    res["params_on"] = next(model.parameters()).device.type
    if r == 0:
        _emit(res)
    hvd.join()


def worker_kill(device: str, log_dir: str) -> None:
    """Train and log each step's time (the orchestrator kills rank 1 mid-run)."""
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd

    hvd.init()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model = torch.nn.Linear(256, 256).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    x = torch.randn(64, 256, device=dev)
    path = os.path.join(log_dir, f"steps-{os.getpid()}.log")

    @hvd.elastic.run
    def train(state: Any) -> None:
        with open(path, "a") as f:
            while state.step < int(os.environ.get("GPU_CHECK_STEPS", "400")):
                F.mse_loss(model(x), x).backward()
                opt.step()
                opt.zero_grad()
                state.step += 1
                state.commit()
                f.write(f"{time.time()} {hvd.rank()} {hvd.size()} {state.step}\n")
                f.flush()
                time.sleep(0.02)

    train(state)


def worker_resets(device: str, log_dir: str) -> None:
    """50 resets of a 1-rank job: each raises HorovodInternalError (a new round, a new NCCL
    group); memory and threads are recorded after each."""
    import torch

    import elasticrun.torch as hvd
    from elasticrun.worker.exceptions import HorovodInternalError

    hvd.init()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model = torch.nn.Linear(1024, 1024).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, resets=0)
    samples: list[dict[str, Any]] = []
    target = int(os.environ.get("GPU_CHECK_RESETS", "50"))

    @hvd.elastic.run
    def train(state: Any) -> None:
        model(torch.ones(4, 1024, device=dev)).sum().backward()
        opt.step()
        opt.zero_grad()
        hvd.allreduce(torch.ones(1 << 20, device=dev))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if state.resets in (1, target):  # after the first reset and the last, once old rounds are released
            time.sleep(2.5)  # an old round's groups go 1 s after it ends; an abort takes about 1 s more
            samples.append({"resets": state.resets, "threads": _threads(),
                            "allocated": torch.cuda.memory_allocated() if dev.type == "cuda" else 0,
                            "reserved": torch.cuda.memory_reserved() if dev.type == "cuda" else 0})
        if state.resets < target:
            state.resets += 1
            state.commit()
            raise HorovodInternalError("gpu_check: a reset")

    train(state)
    _emit({"samples": samples})


def worker_first_step(device: str, log_dir: str) -> None:
    import torch

    import elasticrun.torch as hvd

    hvd.init()
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    hvd.allreduce(torch.ones(1024, device=dev))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    _emit({"first_step": time.time()})


WORKERS = {"paths": worker_paths, "kill": worker_kill, "resets": worker_resets, "first_step": worker_first_step}


# ======================================================================== the measurements
def _result(out: str) -> Any:
    for line in out.splitlines():
        text = line.split(">:", 1)[-1]
        if text.startswith(MARK):
            return json.loads(text[len(MARK):])
    return None


def _job(args: list[str], mode: str, device: str, log_dir: str, timeout: float,
         env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "elasticrun", *args, sys.executable, HERE, "--worker", mode, "--device", device,
           "--log-dir", log_dir]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=log_dir,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                   **(env or {})))
    _keep(log_dir, proc.stdout, proc.stderr)
    return proc, started


def _keep(log_dir: str, out: str, err: str) -> None:
    """The job's whole console beside its workers' files: a row shows only its last lines, and a
    run on a lent GPU cannot be repeated at will."""
    n = sum(1 for f in os.listdir(log_dir) if f.startswith("job-") and f.endswith(".err"))
    for suffix, text in ((".out", out), (".err", err)):
        with open(os.path.join(log_dir, f"job-{n}{suffix}"), "w") as f:
            f.write(text or "")


Row = tuple[str, str, str, Any]  # (check, result, goal, ok: True/False/None for "reported")


def check_paths(device: str, size: int, backend: str, quick: bool) -> list[Row]:
    work = tempfile.mkdtemp(prefix="gpu-check-paths-")
    hosts = "localhost:1,127.0.0.1:1" if size == 2 else "localhost:1"
    args = ["-np", str(size), "-H", hosts, "--backend", backend, "--checkpoint-dir", os.path.join(work, "ckpt"),
            "--checkpoint-interval", "0.5"]
    name = f"paths, {size} rank(s), {backend}"
    rows: list[Row] = []
    try:
        proc, _ = _job(args, "paths", device, work, 180)
        res = _result(proc.stdout)
        if res is None or proc.returncode != 0:
            return [(name, f"job failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-400:]}", "rc 0",
                     False)]
        failed = {k: v for k, v in res.items() if v is not True and k not in ("backend", "rank", "first_epoch",
                                                                              "params_on")}
        total = sum(1 for k, v in res.items() if v is True) + len(failed)
        rows.append((name, f"{total - len(failed)}/{total} paths right; CUDA tensors over {res['backend']}"
                     + (f"; WRONG: {failed}" if failed else ""), "all right", not failed))
        expected = "nccl" if backend == "nccl" else ("gloo" if size == 2 or device != "cuda" else res["backend"])
        rows.append((f"{name}: what carried CUDA tensors", res["backend"], expected, res["backend"] == expected))
        again, _ = _job(args, "paths", device, work, 180)  # the same command: resumes from the durable copy
        res2 = _result(again.stdout) or {}
        resumed = "resumed from checkpoint of" in again.stderr and res2.get("first_epoch", 0) > 0
        rows.append((f"{name}: durable copy from the GPU, resumed onto it",
                     f"resumed at epoch {res2.get('first_epoch')}, params on {res2.get('params_on')} (exit "
                     f"{again.returncode})", f"resumed, params on {device}",
                     resumed and res2.get("params_on") == device and again.returncode == 0))
    except subprocess.TimeoutExpired:
        rows.append((name, "did not finish within 180 s", "rc 0", False))
    return rows


def check_kill(device: str, steps: int = 400) -> list[Row]:
    work = tempfile.mkdtemp(prefix="gpu-check-kill-")
    events = os.path.join(work, "events.jsonl")
    cmd = [sys.executable, "-m", "elasticrun", "-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1",
           "--events", events, sys.executable, HERE, "--worker", "kill", "--device", device, "--log-dir", work]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work,
                            env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                     GPU_CHECK_STEPS=str(steps)),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        victim = None
        while time.monotonic() < deadline and victim is None:
            for f in os.listdir(work):
                if f.startswith("steps-"):
                    lines = open(os.path.join(work, f)).read().split("\n")
                    if len(lines) > 50 and lines[-2].split()[1] == "1":
                        victim = int(f[len("steps-"):-len(".log")])
            time.sleep(0.1)
        if victim is None:
            os.killpg(proc.pid, signal.SIGKILL)
            _keep(work, *proc.communicate(timeout=30))
            return [("kill -9, 2 ranks, gloo", "rank 1 never trained 50 steps", "-", False)]
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        out, err = proc.communicate(timeout=120)
        _keep(work, out, err)
        steps = []
        for f in os.listdir(work):
            if f.startswith("steps-"):
                steps += [tuple(map(float, line.split())) for line in open(os.path.join(work, f)) if line.strip()]
        after = sorted(t for t, rank, size, step in steps if t > killed and size == 1)
        ms = (after[0] - killed) * 1000 if after else float("nan")
        return [("kill -9, 2 ranks, gloo: kill -> next step", f"{ms:.0f} ms ({_kill_phases(events, killed)}; exit "
                 f"{proc.returncode})", "rc 0; reported", proc.returncode == 0 and bool(after))]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _kill_phases(path: str, killed: float) -> str:
    """Where a kill's recovery went, from the job's event log: when the survivor's collective
    failed, when the driver formed the next round, when the survivor's first step completed."""
    from elasticrun.common.events import read_events

    try:
        events = [e for e in read_events(path) if e["t"] >= killed]
    except (OSError, ValueError):
        return "no event log"

    def at(kind: str) -> str:
        t = next((e["t"] for e in events if e["kind"] == kind), None)
        return "-" if t is None else f"{(t - killed) * 1000:.0f}"
    return f"detect {at('failure_detected')}, decide {at('round_formed')}, first step {at('first_step')} ms"


def check_nccl_cycles(cycles: int) -> list[Row]:
    import torch
    import torch.distributed as dist

    from elasticrun.worker import devices

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.HashStore()
    build, reduce_ms, abort_call, mem = [], [], [], []
    x = torch.ones(1 << 20, device=dev)
    for i in range(cycles):
        t0 = time.perf_counter()
        pg = devices.new_nccl(dist.PrefixStore(f"cycle{i}", store), 0, 1, 60.0)
        devices.connect(pg, dev)
        t1 = time.perf_counter()
        work = pg.allreduce([x])
        while not work.is_completed():
            time.sleep(0.0001)
        work.wait()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        devices.abort_soon(pg, "gpu_check")
        t3 = time.perf_counter()
        del pg, work
        build.append((t1 - t0) * 1000)
        reduce_ms.append((t2 - t1) * 1000)
        abort_call.append((t3 - t2) * 1000)
        devices.settle_aborts(10)
        mem.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), _threads()))
    first, last = mem[0], mem[-1]
    flat = last[0] <= first[0] and last[1] <= first[1] and last[2] <= first[2] + 2
    return [
        (f"NCCL x{cycles}: build (first / median)", f"{build[0]:.0f} / {statistics.median(build[1:]):.1f} ms", "-",
         None),
        (f"NCCL x{cycles}: 4 MB allreduce (median)", f"{statistics.median(reduce_ms):.2f} ms", "-", None),
        (f"NCCL x{cycles}: abort, the caller's wait (max)", f"{max(abort_call):.2f} ms", "< 5 ms (never waited on)",
         max(abort_call) < 5),
        (f"NCCL x{cycles}: memory and threads, 1st -> last",
         f"allocated {first[0] >> 20} -> {last[0] >> 20} MiB, reserved {first[1] >> 20} -> {last[1] >> 20} MiB, "
         f"threads {first[2]} -> {last[2]}", "flat", flat),
    ]


def check_resets(device: str, resets: int) -> list[Row]:
    work = tempfile.mkdtemp(prefix="gpu-check-resets-")
    backend = "nccl" if device == "cuda" else "gloo"
    try:
        proc, _ = _job(["-np", "1", "-H", "localhost:1", "--backend", backend, "--reset-limit", str(resets + 5)],
                       "resets", device, work, 240, env={"GPU_CHECK_RESETS": str(resets)})
    except subprocess.TimeoutExpired:
        return [(f"{resets} resets, {backend}", "did not finish within 240 s", "flat", False)]
    res = _result(proc.stdout)
    if res is None or proc.returncode != 0:
        return [(f"{resets} resets, {backend}", f"job failed (exit {proc.returncode}): {proc.stderr[-400:]}", "flat",
                 False)]
    s = res["samples"]
    first, last = s[0], s[-1]
    flat = (last["allocated"] <= first["allocated"] and last["reserved"] <= first["reserved"]
            and last["threads"] <= first["threads"] + 2)
    return [(f"{last['resets']} resets, {backend}: memory and threads, 1st -> last",
             f"allocated {first['allocated'] >> 20} -> {last['allocated'] >> 20} MiB, reserved "
             f"{first['reserved'] >> 20} -> {last['reserved'] >> 20} MiB, threads {first['threads']} -> "
             f"{last['threads']}", "flat", flat)]


def check_commit(device: str, gigabytes: float, repeats: int) -> list[Row]:
    import torch

    import elasticrun.torch as hvd

    os.environ.pop("ELASTICRUN_CONTROL_ADDR", None)
    hvd.init()  # standalone: one process, no launcher
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    width = 4096
    layers = max(1, int(gigabytes * (1 << 30) / 3 / (width * width * 4)))  # weights + Adam's two moments
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    x = torch.randn(512, width, device=dev)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) * 1000

    tensors = [p for p in model.parameters()] + [v for s in opt.state.values() for v in s.values()
                                                 if isinstance(v, torch.Tensor) and v.numel() > 1]
    raw = [torch.empty_like(t) for t in tensors]
    state = hvd.elastic.TorchState(model=model, optimizer=opt)
    background = hvd.elastic.TorchState(model=model, optimizer=opt, background_commit=True)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    copy_ms, commit_ms, restore_ms, step_ms, after_ms = [], [], [], [], []
    for _ in range(repeats):
        copy_ms.append(timed(lambda: torch._foreach_copy_(raw, tensors)))
        commit_ms.append(timed(state.commit))
        restore_ms.append(timed(state.restore))
        step_ms.append(timed(step))
        background.commit()
        after_ms.append(timed(step))  # waits for the background copy where it must
    on_device = all(b.device.type == dev.type for b in state._handlers["model"]._buffers.values())
    copy, commit, restore = statistics.median(copy_ms), statistics.median(commit_ms), statistics.median(restore_ms)
    plain, after = statistics.median(step_ms), statistics.median(after_ms)
    label = f"{nbytes / 1e9:.2f} GB state"
    return [
        (f"commit(), {label}", f"{commit:.1f} ms = {commit / copy:.2f}x a raw copy ({copy:.1f} ms); copy kept on "
         f"{'the device' if on_device else 'the host'}", "<= 2x", commit <= 2 * copy),
        (f"step after a background commit, {label}", f"{after:.1f} ms = {after / plain:.2f}x a step ({plain:.1f} ms)",
         "<= 1.1x", after <= 1.1 * plain),
        (f"restore(), {label}", f"{restore:.1f} ms = {restore / copy:.2f}x a raw copy", "<= 2x", restore <= 2 * copy),
    ]


def check_launch(device: str) -> list[Row]:
    rows: list[Row] = []
    for label, extra in (("warm start", []), ("--no-warm-start", ["--no-warm-start"])):
        work = tempfile.mkdtemp(prefix="gpu-check-launch-")
        try:
            proc, started = _job(["-np", "1", "-H", "localhost:1", *extra], "first_step", device, work, 120)
        except subprocess.TimeoutExpired:
            rows.append((f"launch -> first step ({label})", "did not finish within 120 s", "<= 3 s", False))
            continue
        res = _result(proc.stdout)
        seconds = res["first_step"] - started if res else float("nan")
        rows.append((f"launch -> first {device} step ({label})", f"{seconds:.2f} s (exit {proc.returncode})",
                     "<= 3 s", bool(res) and seconds <= 3.0))
    return rows


def environment(device: str) -> list[Row]:
    import torch
    import torch.distributed as dist

    rows: list[Row] = [("torch", torch.__version__, "-", None)]
    if device == "cuda":
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
        rows += [("GPU", f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}",
                  "-", None), ("NCCL", nccl, "-", None)]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="smaller state, fewer cycles and resets")
    p.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        WORKERS[a.worker](a.device, a.log_dir)
        return 0
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here: run with --device cpu for a smoke run", file=sys.stderr)
            return 2
    started = time.monotonic()
    rows: list[Row] = environment(a.device)
    parts: list[tuple[str, Callable[[], list[Row]]]] = [
        ("paths, 2 ranks", lambda: check_paths(a.device, 2, "auto", a.quick)),
        # (--device cpu --quick is CI's smoke run of this script: the least that runs every part)
        ("kill", lambda: check_kill(a.device, 150 if a.quick and a.device == "cpu" else 400)),
        ("resets", lambda: check_resets(a.device, (5 if a.device == "cpu" else 10) if a.quick else 50)),
        ("launch", lambda: check_launch(a.device)),
    ]
    if a.device == "cuda":
        parts.insert(1, ("paths, 1 rank, NCCL", lambda: check_paths(a.device, 1, "nccl", a.quick)))
        parts.append(("NCCL cycles", lambda: check_nccl_cycles(5 if a.quick else 20)))
    parts.append(("commit", lambda: check_commit(a.device, (0.1 if a.device == "cpu" else 0.4) if a.quick
                                                 else 0.4 if a.device == "cpu" else 3.2, 3 if a.quick else 7)))
    for name, run in parts:
        t0 = time.monotonic()
        try:
            rows += run()
        except Exception as exc:  # one part's failure is its row; the others still run
            rows.append((name, f"{type(exc).__name__}: {str(exc)[:300]}", "-", False))
        print(f"[gpu_check] {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n| {'check':<{width}} | result | goal | met |\n| {'-' * width} | --- | --- | --- |")
    for check, result, goal, ok in rows:
        print(f"| {check:<{width}} | {result} | {goal} | {'-' if ok is None else 'yes' if ok else 'NO'} |")
    print(f"\n{time.monotonic() - started:.0f} s in all on {a.device}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"check": c, "result": r, "goal": g, "met": ok} for c, r, g, ok in rows], f, indent=1)
    timings = ("<= 2x", "<= 1.1x", "<= 3 s", "-")  # reported: the machine decides them
    return 0 if all(ok is not False for _, _, goal, ok in rows if goal not in timings) else 1


if __name__ == "__main__":
    sys.exit(main())
