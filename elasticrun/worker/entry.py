"""The worker process of ``elasticrun.run(fn, ...)``: ``python -m elasticrun.worker.entry``.

1. Fetch the pickled ``(fn, args, kwargs)`` from the driver over the authenticated control
   channel (in parts, each frame under the protocol's size limit) and unpickle it: this
   imports what the function needs *before* joining, so survivors do not wait for it.
2. ``hvd.init()`` (join the job), then call ``fn(*args, **kwargs)``.
3. Send the pickled return value, or the exception and its formatted traceback, back to the
   driver (in parts), wait for the driver's acknowledgement, and exit (0, or 1 on an error).

A worker dismissed by the driver (no place in a later round) exits 0 from inside ``fn`` via
``SystemExit`` and sends nothing: only the final round's ranks count.
"""

from __future__ import annotations

import base64
import os
import sys
import traceback
from typing import Any

import cloudpickle
import zmq

from elasticrun.common import env
from elasticrun.common.auth import BadKeys
from elasticrun.common.protocol import MAX_FRAME_BYTES
from elasticrun.common.secretpipe import SecretUnavailable
from elasticrun.worker.client import DriverClient, job_keys

#: Raw bytes per part: their base64 (4/3) plus the JSON envelope stay under the frame limit.
PART_BYTES = MAX_FRAME_BYTES // 2
TIMEOUT = 30.0


def _fetch(client: DriverClient, worker_id: str) -> tuple[bytes, list[str]]:
    parts: list[bytes] = []
    sys_path: list[str] = []
    total = 1
    while len(parts) < total:
        msg = client.request("function", {"worker": worker_id, "part": len(parts)}, timeout=TIMEOUT,
                             what=f"part {len(parts)} of the function to run")
        if "error" in msg.body:
            raise RuntimeError(f"the driver has no function to run: {msg.body['error']}")
        total = int(msg.body["parts"])
        parts.append(base64.b64decode(msg.body["data"]))
        sys_path = sys_path or list(msg.body.get("sys_path") or [])
    return b"".join(parts), sys_path


def _send(client: DriverClient, worker_id: str, kind: str, blob: bytes, **extra: Any) -> None:
    parts = [blob[i:i + PART_BYTES] for i in range(0, len(blob), PART_BYTES)] or [b""]
    from elasticrun.worker import runtime

    rt = runtime.get() if runtime.is_initialized() else None
    where = {"rank": rt.rank, "round": rt.round} if rt is not None else {}
    for i, part in enumerate(parts):
        client.request("result", dict(extra, worker=worker_id, kind=kind, part=i, parts=len(parts),
                                      data=base64.b64encode(part).decode(), **where),
                       timeout=TIMEOUT, what=f"part {i} of this worker's {kind}")


def _send_error(client: DriverClient, worker_id: str, exc: BaseException) -> None:
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)  # an exception that cannot be rebuilt travels as text only
    except Exception:
        blob = b""
    _send(client, worker_id, "error", blob, error=f"{type(exc).__name__}: {exc}"[:2000], traceback=trace)


def main() -> int:
    worker_id = os.environ.get(env.WORKER_ID)
    if env.CONTROL_ADDR not in os.environ or worker_id is None:
        sys.stderr.write("elasticrun.worker.entry runs the workers of elasticrun.run(); it is not meant "
                         "to be started by hand\n")
        return 2
    from elasticrun.worker import runtime

    try:  # read from the launcher's pipe once; the runtime's connection reuses them
        keys = job_keys()
    except (SecretUnavailable, BadKeys) as exc:
        sys.stderr.write(f"elasticrun: {exc}\n")
        return 2
    ctx = zmq.Context()
    client = DriverClient(ctx, os.environ[env.CONTROL_ADDR], keys, os.environ[env.JOB_ID], "entry")
    try:
        try:
            blob, sys_path = _fetch(client, worker_id)
            # Functions pickled by reference name modules the caller could import: look
            # where the caller looked, after this interpreter's own path.
            sys.path.extend(p for p in sys_path if p not in sys.path)
            fn, args, kwargs = cloudpickle.loads(blob)
            runtime.init()
            value = fn(*args, **kwargs)
            try:
                out = cloudpickle.dumps(value)
            except Exception as exc:
                raise TypeError(f"the return value of the function ({type(value).__name__}) "
                                f"cannot be pickled: {exc}") from exc
        except Exception as exc:
            traceback.print_exc()  # streams to the caller's console with this rank's prefix
            sys.stderr.flush()
            try:  # first the traceback, then the failure report that makes the driver abort the round
                _send_error(client, worker_id, exc)
            except Exception as send_exc:
                sys.stderr.write(f"elasticrun: could not send this error to the driver: {send_exc}\n")
            if runtime.is_initialized():
                runtime.get().report_failure(f"{type(exc).__name__}: {exc}")
            return 1
        _send(client, worker_id, "value", out)
        return 0
    finally:
        client.close()
        runtime.shutdown(exiting=True)
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
