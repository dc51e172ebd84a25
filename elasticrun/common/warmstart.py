"""Warm worker start, the pure part: which commands a template can run, and its wire format.

A *template* (``elasticrun/worker/template.py``) is a process per host that has imported
torch and elasticrun once and forks every new worker of that host. The launchers (the local
one in ``driver/launch/local.py`` and ``driver/launch/warm.py``; the remote bootstrap for SSH hosts) ask
it over a unix socket. This module holds what both sides must agree on, with no I/O:

* :func:`python_command`: whether a worker command is ``python [-u] SCRIPT ARGS...`` or
  ``python [-u] -m MODULE ARGS...`` (anything else runs as a fresh process);
* :func:`startup_differences`: the environment variables a Python process (or a library
  torch loads) reads only when it starts, so a worker whose value differs from the
  template's must start fresh;
* the wire format. The client connects and sends one request: a 4-byte big-endian length
  and that many bytes of ASCII JSON, the first ``sendmsg`` carrying the worker's standard
  input, output and error (and the job's key pipe, when there is one) as SCM_RIGHTS
  descriptors, in that order. The template answers with JSON lines: ``{"fallback": why}``
  (start a fresh process instead; the connection ends), or ``{"pid": N}`` (the worker runs,
  in its own session: N is also its process group) and later ``{"exit": code}`` with its
  status as ``subprocess`` gives it (negative: killed by that signal). A client that
  disconnects before the exit gets its worker stopped (SIGTERM, SIGKILL after ``grace``).

The remote bootstrap speaks the same format with its own (standard library, Python 3.6)
copy of :func:`encode_request`; ``tests/unit/test_warmstart.py`` checks they agree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elasticrun.common import env as envvars

#: Protocol version, in every request; a template refuses (falls back) on another.
VERSION = 1
#: The largest request a template accepts (a worker's environment is a few KiB).
MAX_REQUEST_BYTES = 16 << 20
#: The first line a template prints on its standard output once it serves, before JSON.
READY_PREFIX = "elasticrun-template ready "
#: Descriptors a request carries, in order; the key pipe and the death notice are optional.
FD_NAMES = ("stdin", "stdout", "stderr", "keys", "notice")

_PYTHON_NAME = re.compile(r"python(3(\.\d+)?)?")


@dataclass(frozen=True)
class PythonCommand:
    """A worker command a template can run: ``interpreter [-u] target args`` or ``-m target``
    (or elasticrun's own :func:`own_module_command`, ``safe``: nothing put first on sys.path)."""

    interpreter: str  # as given: "python", "python3.11", "/venv/bin/python"
    kind: str  # "script" or "module"
    target: str  # the script's path as given, or the module's dotted name
    args: tuple[str, ...]  # what follows: sys.argv[1:]
    unbuffered: bool = False  # -u
    safe: bool = False  # own_module_command: the current directory is not put on sys.path

    @property
    def argv(self) -> list[str]:
        """``sys.argv`` before the script runs (``-m``: runpy puts the module's file first)."""
        return [self.target if self.kind == "script" else "-m", *self.args]


#: ``python -c OWN_MAIN MODULE ARGS...`` runs MODULE as ``python -m MODULE ARGS...`` does, but
#: without the current directory first on ``sys.path``. elasticrun starts its own processes
#: (the warm-start template, ``elasticrun.run``'s workers) this way: ``python -m`` would import
#: ``json.py`` or ``selectors.py`` from wherever the job was started, and a neighbour who
#: planted them in a shared directory (/tmp, a team's scratch) would run code as you. Only the
#: empty entry ``-c`` puts there is dropped (with ``-P`` or PYTHONSAFEPATH there is none); the
#: code runs before anything but ``sys`` is imported, on any Python 3.
NO_CWD = "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]"
OWN_MAIN = NO_CWD + "; import runpy; runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"


def own_module_command(python: str, module: str, *args: str) -> list[str]:
    """The command line that runs elasticrun's ``module`` with ``python`` (see OWN_MAIN)."""
    return [python, "-c", OWN_MAIN, module, *args]


def python_command(command: Sequence[str]) -> tuple[PythonCommand | None, str]:
    """``(PythonCommand, "")`` if a template can run ``command``, else ``(None, why not)``.

    Only ``python``/``python3``/``python3.N`` (any directory) with no interpreter option but
    ``-u``, running a script or ``-m module``; ``torchrun``, ``bash -c``, ``python -X ...``,
    ``python -c`` and the like start as fresh processes.
    """
    if not command:
        return None, "there is no command"
    prog = command[0]
    if not _PYTHON_NAME.fullmatch(os.path.basename(prog)):
        return None, f"{os.path.basename(prog)!r} is not a Python interpreter"
    unbuffered = False
    i = 1
    while i < len(command):
        word = command[i]
        if word == "-u":
            unbuffered = True
            i += 1
            continue
        if word == "-c" and i + 2 < len(command) and command[i + 1] == OWN_MAIN:
            module = command[i + 2]
            if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", module):
                return None, f"-m {module!r} is not a module name"
            return PythonCommand(prog, "module", module, tuple(command[i + 3:]), unbuffered, safe=True), ""
        if word == "-m" or (word.startswith("-m") and not word.startswith("--")):
            module = word[2:] or (command[i + 1] if i + 1 < len(command) else "")
            rest = command[i + 1:] if word[2:] else command[i + 2:]
            if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", module):
                return None, f"-m {module!r} is not a module name"
            return PythonCommand(prog, "module", module, tuple(rest), unbuffered), ""
        if word == "--":
            i += 1
            if i >= len(command):
                break
            return PythonCommand(prog, "script", command[i], tuple(command[i + 1:]), unbuffered), ""
        if word.startswith("-"):
            return None, f"the interpreter option {word!r} (a template runs only -u, -m and scripts)"
        return PythonCommand(prog, "script", word, tuple(command[i + 1:]), unbuffered), ""
    return None, "no script or module to run"


# Read once, when the interpreter or a library it loads starts (locale, allocator, thread
# pools, site-packages, import-time settings): a worker whose value differs from the
# template's would silently run with the template's. CUDA_*, NCCL_*, GLOO_* are read lazily
# (CUDA is never initialised in a template), TZ is re-read in the child (time.tzset()), and
# PYTHONUNBUFFERED only shapes the standard streams, which the child sets up itself.
_STARTUP_PREFIXES = ("PYTHON", "LD_", "LC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_",
                     "BLIS_", "TORCH_", "PYTORCH_", "MALLOC_", "GLIBC_")
_STARTUP_NAMES = frozenset({"LANG", "LANGUAGE", "HOME"})
_NOT_STARTUP = frozenset({"PYTHONUNBUFFERED"})


def is_startup_variable(name: str) -> bool:
    """Whether a process reads ``name`` only at start (see the list above)."""
    return name not in _NOT_STARTUP and (name in _STARTUP_NAMES or name.startswith(_STARTUP_PREFIXES))


def startup_differences(template_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """Names of start-up variables set differently (or only on one side), sorted."""
    names = {n for n in (*template_env, *worker_env) if is_startup_variable(n)}
    return sorted(n for n in names if template_env.get(n) != worker_env.get(n))


def interpreter_path(cmd: PythonCommand, env: Mapping[str, str], cwd: str) -> str | None:
    """The interpreter the command names, looked up as ``execvpe`` would: an absolute path,
    or None if there is no such executable."""
    prog = cmd.interpreter
    if os.sep in prog:
        found = prog if os.path.isabs(prog) else os.path.join(cwd, prog)
        return found if os.path.isfile(found) and os.access(found, os.X_OK) else None
    on_path = shutil.which(prog, path=env.get("PATH", os.defpath))
    return os.path.abspath(on_path) if on_path else None


#: The driver->worker variables of one worker (elasticrun.common.env): not a template's.
_PER_WORKER = frozenset(v for k, v in vars(envvars).items()
                        if k.isupper() and isinstance(v, str) and v.startswith("ELASTICRUN_")) | frozenset(
    # the same placement under Horovod's and torch.distributed's names (driver/environment.py)
    [f"HOROVOD_{k}" for k in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")]
    + ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])


def template_environment(worker_env: Mapping[str, str]) -> dict[str, str]:
    """A host's template environment from one of its workers': without the worker's own
    ``ELASTICRUN_*`` variables (rank, addresses, the key pipe's number, ...) and their
    Horovod/torch.distributed twins (``HOROVOD_RANK``, ``RANK``, ...)."""
    return {k: v for k, v in worker_env.items() if k not in _PER_WORKER}


def unbuffered(cmd: PythonCommand, env: Mapping[str, str]) -> bool:
    """Whether the worker's stdout and stderr are unbuffered (``-u`` or ``PYTHONUNBUFFERED``)."""
    return cmd.unbuffered or bool(env.get("PYTHONUNBUFFERED"))


# --- what /proc shows ------------------------------------------------------------------------
#: A variable of filler a template starts with (last), so that its environment area is large
#: enough for any worker's environment: see :func:`environ_area`. It never reaches a worker.
ROOM_VAR = "ELASTICRUN_TEMPLATE_ROOM"
#: Its size; and the room left after a template's arguments for a worker's command line.
ROOM_BYTES = 16384
ARGV_ROOM = 4096


def with_room(env: Mapping[str, str]) -> dict[str, str]:
    """A template's environment: ``env`` and, last, the filler variable."""
    out = {k: v for k, v in env.items() if k != ROOM_VAR}
    out[ROOM_VAR] = "." * ROOM_BYTES
    return out


def _entry(name: str, value: str) -> bytes:
    return os.fsencode(name) + b"=" + os.fsencode(value)


def environ_area(original: bytes, env: Mapping[str, str]) -> bytes | None:
    """What to write over a forked worker's environment area (the template's, ``original``,
    which ``/proc/PID/environ`` and ``ps e`` read) so that it lists ``env``: the same length,
    NUL-padded; None if ``env`` does not fit.

    Leading entries that ``env`` has unchanged stay where they are, byte for byte (a library
    may have kept a pointer from ``getenv`` at start); the rest of ``env`` follows.
    """
    want = {os.fsencode(k): _entry(k, v) for k, v in env.items() if k != ROOM_VAR}
    out = bytearray()
    kept: set[bytes] = set()
    for item in original.split(b"\0"):
        name = item.partition(b"=")[0]
        if not item or name in kept or want.get(name) != item:
            break
        out += item + b"\0"
        kept.add(name)
    for name, item in want.items():
        if name not in kept:
            out += item + b"\0"
    if len(out) > len(original):
        return None
    return bytes(out) + b"\0" * (len(original) - len(out))


def argv_area(size: int, command: Sequence[str]) -> bytes | None:
    """The worker's command line for its argument area (``/proc/PID/cmdline``, ``ps``): NUL
    separated and padded to ``size``; None if it does not fit."""
    out = b"".join(os.fsencode(w) + b"\0" for w in command)
    return out + b"\0" * (size - len(out)) if len(out) <= size else None


# --- wire format -----------------------------------------------------------------------------
class WireError(ValueError):
    """A malformed request or reply."""


def encode_request(command: Sequence[str], env: Mapping[str, str], cwd: str, grace: float,
                   keys: bool, notice: bool = False) -> bytes:
    """A request: the length prefix and the JSON. ``keys``: a fourth descriptor is the key pipe;
    ``notice``: the next one is the worker's death notice (``common/deathnotice.py``)."""
    fields: dict[str, Any] = {"v": VERSION, "command": list(command), "env": dict(env), "cwd": cwd,
                              "grace": float(grace), "keys": bool(keys)}
    if notice:  # absent otherwise: remote_bootstrap.py's copy of this function never sends one
        fields["notice"] = True
    body = json.dumps(fields, sort_keys=True).encode("ascii")
    return struct.pack(">I", len(body)) + body


def request_length(prefix: bytes) -> int:
    """The JSON's length from a request's first 4 bytes (WireError if it is too large)."""
    (n,) = struct.unpack(">I", prefix)
    if n > MAX_REQUEST_BYTES:
        raise WireError(f"a request of {n} bytes is over the {MAX_REQUEST_BYTES}-byte limit")
    return n


def decode_request(body: bytes, fds: int) -> dict[str, Any]:
    """Check a request's JSON (``fds``: how many descriptors came with it)."""
    try:
        req = json.loads(body.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"not a request: {exc}") from None
    if not isinstance(req, dict) or req.get("v") != VERSION:
        raise WireError(f"not a version {VERSION} request")
    command, env, cwd = req.get("command"), req.get("env"), req.get("cwd")
    if not (isinstance(command, list) and command and all(isinstance(w, str) for w in command)):
        raise WireError("the command must be a list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise WireError("the environment must map strings to strings")
    if not isinstance(cwd, str) or not isinstance(req.get("grace"), (int, float)):
        raise WireError("cwd must be a string and grace a number")
    need = 3 + bool(req.get("keys")) + bool(req.get("notice"))
    if fds != need:
        raise WireError(f"{fds} descriptors came with a request that needs {need}")
    return req


def reply(**fields: Any) -> bytes:
    """One reply line."""
    return (json.dumps(fields, sort_keys=True) + "\n").encode("ascii")


def decode_reply(line: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(line.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"not a reply: {line[:80]!r}: {exc}") from None
    if not isinstance(msg, dict):
        raise WireError(f"not a reply: {line[:80]!r}")
    return msg


def exit_code(status: int) -> int:
    """A wait status as ``subprocess`` reports it: the exit code, or -N for signal N."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
