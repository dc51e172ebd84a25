"""What one worker connection costs the driver: CURVE handshake + ZAP, against a plain connection.

    flock /tmp/elasticrun-heavy.lock python benchmarks/curve_connect.py [--connections 1000]
        [--repeats 3] [--io-threads 1]

A server process binds a ROUTER as the driver does (elasticrun.common.auth.secure_server, the
same ZAP handler, BACKLOG 4096) and echoes one frame per connection; a client process opens
``--connections`` DEALER sockets, each sends one frame and waits for its echo. Measured in the
server, per connection: the CPU of ZeroMQ's I/O threads (accept, handshake, encryption) and of
every other thread (the echo loop, the ZAP handler), from /proc (Linux). Three mechanisms, in
the same run and interleaved:

  null        no security: the baseline, what accepting a TCP connection and one frame cost
  curve       CURVE without a ZAP handler (any client key gets in: not what the driver runs)
  curve+zap   CURVE, and the ZAP handler admits only the job's key, on a thread of its own
  zap-inline  what the driver runs: the same, the ZAP requests answered by the echo loop
              itself (ZapAuthenticator.start_inline), as the driver's loop answers them

A worker opens two such connections (requests; heartbeats, which also carry notifications),
three with --checkpoint-dir (durable copies), so round 0 of N workers costs the driver's I/O
threads about 2 N to 3 N times the zap-inline figure
(benchmarks/driver_scale.py splits its CPU by thread to compare).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import zmq  # noqa: E402
from _threads import spent, thread_cpu  # noqa: E402

from elasticrun.common import auth  # noqa: E402

MODES = ("null", "curve", "curve+zap", "zap-inline")


def _server(mode: str, keys: auth.JobKeys, n: int, io_threads: int, conn) -> None:
    ctx = zmq.Context(io_threads=io_threads)
    zap = auth.ZapAuthenticator(ctx, [keys.worker.client_public]) if mode in ("curve+zap", "zap-inline") else None
    zap_sock = None  # the handler's socket, when this loop answers it
    if mode == "zap-inline":
        zap_sock = zap.start_inline()
    elif zap is not None:
        zap.start()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.BACKLOG, 4096)
    if mode != "null":
        auth.secure_server(sock, keys, 1 << 20)
    conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    before = thread_cpu()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if zap_sock is not None:
        poller.register(zap_sock, zmq.POLLIN)
    echoed = 0
    while echoed < n:
        ready = dict(poller.poll(60_000))
        if not ready:
            conn.send(None)
            break
        if zap_sock in ready:
            zap.serve()
        while echoed < n:
            try:
                sock.send_multipart(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            echoed += 1
    else:
        by_thread = spent(before, thread_cpu()).values()
        io = sum(cpu for name, cpu in by_thread if name.startswith("ZMQbg/IO"))
        rest = sum(cpu for name, cpu in by_thread if not name.startswith("ZMQbg/"))
        conn.send((io, rest))
    conn.recv()  # the client is done: close
    sock.close(0)
    if zap is not None:
        zap.stop()
    ctx.term()


def _run(mode: str, keys: auth.JobKeys, n: int, io_threads: int) -> tuple[float, float, float]:
    """(wall s, server I/O CPU s, server other CPU s) for ``n`` connections."""
    mine, theirs = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_server, args=(mode, keys, n, io_threads, theirs))
    proc.start()
    try:
        if not mine.poll(30):
            raise RuntimeError("the server process did not start within 30 s")
        port = mine.recv()
        ctx = zmq.Context()
        socks = []
        start = time.perf_counter()
        for _ in range(n):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if mode != "null":
                auth.secure_client(s, keys.worker, 1 << 20)
            s.connect(f"tcp://127.0.0.1:{port}")
            s.send(b"x")
            socks.append(s)
        for s in socks:
            if not s.poll(60_000):
                raise RuntimeError(f"{mode}: a connection got no echo within 60 s")
            s.recv()
        wall = time.perf_counter() - start
        if not mine.poll(30):
            raise RuntimeError("the server did not report its CPU within 30 s")
        got = mine.recv()
        if got is None:
            raise RuntimeError(f"{mode}: the server saw fewer than {n} frames")
        mine.send("done")
        for s in socks:
            s.close(0)
        ctx.term()
        return wall, got[0], got[1]
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--io-threads", type=int, default=1, help="the server context's ZeroMQ I/O threads")
    args = p.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * args.connections + 256
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            p.error(f"{args.connections} connections need ~{need} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    keys = auth.JobKeys.generate()
    got: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            got[mode].append(_run(mode, keys, args.connections, args.io_threads))
    n = args.connections
    base = statistics.median(io + rest for _, io, rest in got["null"]) / n
    print(f"{n} connections, each one frame echoed; server with {args.io_threads} ZeroMQ I/O thread(s); "
          f"medians of {args.repeats}")
    print("| mechanism | server CPU per connection | of which I/O threads | other threads (loop, ZAP) "
          "| wall, all connections | CPU / null |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode in MODES:
        io = statistics.median(r[1] for r in got[mode]) / n
        rest = statistics.median(r[2] for r in got[mode]) / n
        wall = statistics.median(r[0] for r in got[mode])
        total = statistics.median(r[1] + r[2] for r in got[mode]) / n
        print(f"| {mode} | {total * 1e3:.3f} ms | {io * 1e3:.3f} ms | {rest * 1e3:.3f} ms | {wall:.2f} s "
              f"| {total / base if base else float('nan'):.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
