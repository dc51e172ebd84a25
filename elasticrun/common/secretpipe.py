"""Handing the job's keys to a worker through an inherited pipe, not its environment.

Why not the environment: ``/proc/PID/environ`` shows a process's environment as it was at
``exec`` for as long as the process lives (removing a variable from ``os.environ`` later does
not change it), and every child inherits the environment: a DataLoader worker, a shell, any
subprocess the training script starts would carry the job's keys.

How: the launcher writes the key blob into a fresh pipe, closes the write end and passes the
read end to the worker (``pass_fds``; remotely, the SSH bootstrap does the same for the process
it execs). Its number is in ``ELASTICRUN_SECRET_FD``. The worker reads the blob once at
``init`` and closes the descriptor (:func:`receive`). The blob is tiny and the write end is
closed before the worker starts, so the launcher never blocks, whether or not the worker ever
reads it (the kernel frees the pipe with the last process holding it); and the reader sees EOF
right after the data.
"""

from __future__ import annotations

import errno
import os
import select
import time
from typing import MutableMapping

from elasticrun.common import env

FD_VAR = env.SECRET_FD
#: Far more than a key blob (~250 bytes), far less than a pipe's buffer (64 KiB on Linux, at
#: least 4 KiB by POSIX), so writing never blocks.
MAX_BYTES = 4096


class SecretUnavailable(RuntimeError):
    """The worker could not read its keys; the message says why (never what)."""


def hand_over(blob: bytes) -> int:
    """A pipe holding ``blob``; returns its read end (not inheritable: pass it with ``pass_fds``)."""
    if len(blob) > MAX_BYTES:
        raise ValueError(f"a key blob of {len(blob)} bytes is over the {MAX_BYTES}-byte limit")
    r, w = os.pipe()
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(w, view):]
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


def receive(environ: MutableMapping[str, str] | None = None, timeout: float = 10.0) -> bytes:
    """Read the blob from the descriptor named by ``ELASTICRUN_SECRET_FD`` and close it.

    The variable is removed from ``environ`` (``os.environ`` by default) so children do not
    look for a descriptor that is gone. Raises :class:`SecretUnavailable` if there is none, it
    is not a readable pipe, it holds nothing, or it does not reach EOF within ``timeout`` s.
    """
    environ = os.environ if environ is None else environ
    raw = environ.pop(FD_VAR, None)
    if raw is None:
        raise SecretUnavailable(f"this worker was started without its keys ({FD_VAR} is not set); "
                                f"workers must be started by elasticrun, and can read their keys only once")
    try:
        fd = int(raw)
        if fd < 3:
            raise ValueError
    except ValueError:
        raise SecretUnavailable(f"{FD_VAR}={raw[:20]!r} is not a file descriptor number") from None
    try:
        data = _read_all(fd, timeout)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    if not data:
        raise SecretUnavailable(f"the key pipe (descriptor {fd}) was empty: the keys were read already "
                                f"(they can be read once per worker process)")
    return data


def _read_all(fd: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SecretUnavailable(f"the keys did not arrive on descriptor {fd} within {timeout:g} s")
        # poll(), not select(): the number is the launcher's, and a driver with a thousand
        # workers holds descriptors well past select()'s limit of 1024.
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        ready = poller.poll(max(1, int(left * 1000)))
        if not ready:
            continue
        if ready[0][1] & select.POLLNVAL:
            raise SecretUnavailable(f"descriptor {fd} ({FD_VAR}) cannot be read: it is not open")
        try:
            chunk = os.read(fd, MAX_BYTES + 1)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR):
                continue
            raise SecretUnavailable(f"descriptor {fd} ({FD_VAR}) cannot be read: "
                                    f"{exc.strerror or exc}") from None
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BYTES:
            raise SecretUnavailable(f"descriptor {fd} ({FD_VAR}) holds more than a key blob")
