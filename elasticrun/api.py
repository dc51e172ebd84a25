"""``elasticrun.run(fn, ...)``: launch a Python function elastically, like ``horovod.run``.

The function and its arguments are pickled with cloudpickle and fetched by every worker from
the driver over the authenticated control channel (never unpickled before the HMAC check).
Each worker process (``python -m elasticrun.worker.entry``) joins the job (``hvd.init()`` is
done for it), calls ``fn(*args, **kwargs)`` and sends back its return value, or its exception
and traceback. ``run`` returns the values of the final round's ranks, ordered by rank.

Options are validated by the command line's own parser, so ``run`` and ``elasticrun`` reject
the same bad input with the same message (``run`` raises it as ValueError).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import cloudpickle

from elasticrun.common.errors import JobFailed
from elasticrun.common.warmstart import own_module_command
from elasticrun.driver import words
from elasticrun.driver.functions import FunctionService, Result
from elasticrun.driver.registry import WorkerRecord

__all__ = ["run", "RunError"]

#: ``python -m elasticrun.worker.entry``, without the current directory on sys.path (OWN_MAIN).
WORKER_COMMAND = own_module_command(sys.executable, "elasticrun.worker.entry")
#: horovod.run's keywords (and ours) named otherwise by the command line.
_ALIASES = {"discovery_script": "host_discovery_script", "cooldown_range": "blacklist_cooldown_range",
            "num_proc": "np", "min_num_proc": "min_np", "max_num_proc": "max_np", "slots": "slots_per_host",
            "network_interfaces": "network_interface", "nics": "network_interface"}
#: horovod.run's keywords that change nothing here (a check cache, the controller's name).
_ACCEPTED = {"disable_cache", "use_gloo"}


def _horovod_keywords(options: dict[str, Any]) -> tuple[dict[str, Any], list[str] | None]:
    """Translate horovod.run's keywords to ours: aliases, the ones that change nothing, the
    ones that need MPI (refused); ``executable`` becomes the workers' Python. Returns the
    options and the worker command (None: the default)."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = _ALIASES.get(key, key)
        if value is None and name in out:  # run(num_proc=2) leaves np=None: the alias wins
            continue
        if name in out and out[name] is not None and value is not None and out[name] != value:
            raise ValueError(f"{key}= and another name of the same option disagree ({out[name]!r} vs {value!r})")
        if key == "use_mpi":
            if value:
                raise ValueError("use_mpi=True: elasticrun has no MPI controller; its workers always talk over gloo "
                                 "(leave use_mpi out, or pass use_gloo=True)")
            continue
        if key in ("mpi_args", "use_jsrun"):
            if value:
                raise ValueError(f"{key}=: elasticrun has no MPI (nor jsrun) launcher")
            continue
        if key in _ACCEPTED:
            continue
        if name == "network_interface" and value is not None and not isinstance(value, str):
            value = ",".join(map(str, value))  # nics=["eth0", "eth1"]: --network-interfaces eth0,eth1
        if key == "env" and isinstance(value, Mapping) and isinstance(out.get("env"), dict):
            value = {**out["env"], **value}
        if key == "verbose" and type(value) is int:
            value = value > 0  # horovod.run also takes a level
        out[name] = value
    executable = out.pop("executable", None)
    command = own_module_command(str(executable), "elasticrun.worker.entry") if executable else None
    return out, command


class RunError(JobFailed):
    """``elasticrun.run`` failed. ``str()`` has the job's failure reason and, when a rank's
    function raised, that rank's traceback; the exception it raised (when it could be
    pickled) is the ``__cause__``.

    Attributes: ``reason`` (the job's failure paragraph), ``exit_code`` (as the CLI's),
    ``rank``/``host`` (the failing rank, or None), ``remote_traceback`` (str or None), and
    ``failures``: every error a worker sent, oldest first (dicts: round, rank, host, error, traceback).
    """

    def __init__(self, reason: str, exit_code: int = 1, failure: Result | None = None,
                 failures: list[Result] | None = None):
        message = reason
        if failure is not None:
            message += (f"\n\nrank {failure.rank} ({failure.host}[{failure.slot}]) raised "
                        f"{failure.error}; its traceback:\n{failure.traceback.rstrip()}")
        super().__init__(message, exit_code)
        self.reason = reason
        self.rank = failure.rank if failure else None
        self.host = failure.host if failure else None
        self.remote_traceback = failure.traceback if failure else None
        self.failures = [{"worker": f.worker, "round": f.round, "rank": f.rank, "host": f.host, "slot": f.slot,
                          "error": f.error, "traceback": f.traceback} for f in failures or []]


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
        np: int | None = None, min_np: int | None = None, max_np: int | None = None,
        hosts: str | Mapping[str, int] | Sequence[str] | None = None, hostfile: str | None = None,
        discovery_script: str | None = None, discovery: Callable[[], Mapping[str, int]] | None = None,
        **options: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every worker of an elastic job; return the final round's values.

    Give at most one host source (none: ``localhost:np``, as ``horovod.run``):
    ``hosts`` ("h1:2,h2:2", ``{"h1": 2}`` or ``["h1:2"]``),
    ``hostfile``, ``discovery_script`` (a path) or ``discovery`` (a callable returning
    ``{host: slots}``, called in this process every ``discovery_interval`` seconds on a
    separate thread; raising, returning something else or not returning within
    ``discovery_timeout`` counts as a failed discovery run). Any other option of the
    ``elasticrun`` command is a keyword named like its long flag (``elastic_timeout=60``,
    ``reset_limit=3``, ``env={"NAME": "value"}``, ``verbose=True``, ...).

    ``horovod.run``'s keywords work too: ``num_proc``, ``min_num_proc``, ``max_num_proc``,
    ``slots``, ``cooldown_range``, ``host_discovery_script``, ``network_interface(s)``/``nics``
    (several: the driver listens on the first, gloo gets them all), ``executable`` (the
    workers' Python), ``np`` defaulting to 1, ``prefix_output_with_timestamp``; ``use_gloo`` and
    ``disable_cache`` are accepted and change nothing; ``use_mpi=True`` and ``mpi_args`` are
    refused (there is no MPI here).

    Raises ValueError for bad options (the command line's message), TypeError for an unknown
    keyword or something that cannot be pickled, and :class:`RunError` when the job fails or a
    rank of the final round returned no value. Worker output streams to ``sys.stdout`` /
    ``sys.stderr`` with rank prefixes; the driver's messages go to ``sys.stderr``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if discovery is not None and not callable(discovery):
        raise TypeError(f"discovery must be a callable returning {{host: slots}}, got {type(discovery).__name__}")
    given = [name for name, v in (("hosts", hosts), ("hostfile", hostfile), ("discovery_script", discovery_script),
                                  ("discovery", discovery)) if v is not None]
    if discovery is not None and len(given) > 1:
        raise ValueError(f"discovery= cannot be combined with {given[0]}=: give one host source")
    if discovery is not None and options.get("ray_address") is not None:
        raise ValueError("discovery= cannot be combined with ray_address=: give one host source")

    from elasticrun.driver.cli.command import settings_from_keywords

    keywords, command = _horovod_keywords(dict(options, np=np, min_np=min_np, max_np=max_np, hosts=hosts,
                                               hostfile=hostfile, discovery_script=discovery_script))
    if keywords.get("np") is None:
        keywords["np"] = 1  # horovod.run's default
    settings = settings_from_keywords(keywords, command or WORKER_COMMAND, callable_discovery=discovery is not None)
    try:
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise TypeError(f"the function or its arguments cannot be pickled: {exc}") from exc

    from elasticrun.driver.compose import job_parts
    from elasticrun.driver.driver import ElasticDriver

    threads_before = set(threading.enumerate())
    functions = FunctionService(payload, [os.path.abspath(p or ".") for p in sys.path if os.path.isdir(p or ".")])
    with _driver_logging(settings.log_level), contextlib.ExitStack() as stack:
        try:
            # ray_address="auto": Ray's nodes are the hosts (docs/ray.md)
            source, launcher = job_parts(settings, stack, discovery)
            driver = ElasticDriver(settings, source, launcher, services=[functions])
            code = driver.run()
        except JobFailed as exc:
            failures = functions.errors()
            last = _root_cause(failures)
            raise RunError(str(exc), exc.exit_code, last, failures) from _exception(last)
        finally:
            _join_new_threads(threads_before, deadline=time.monotonic() + 5.0)
    if code != 0:
        name = signal.Signals(code - 128).name if code > 128 else f"exit code {code}"
        if code > 128 and threading.current_thread() is threading.main_thread():
            # The workers are stopped and our handlers are gone: let the caller's handler act
            # (KeyboardInterrupt for SIGINT; the default SIGTERM action ends the program).
            signal.raise_signal(code - 128)
        raise RunError(f"The job was stopped by {name}.", code)
    return _final_values(driver.registry.final_round(), functions)


# --- results -------------------------------------------------------------------------------
def _root_cause(failures: list[Result]) -> Result | None:
    """The first error of the last round that had errors (later ones are usually its echoes)."""
    if not failures:
        return None
    last_round = max(f.round for f in failures)
    return next(f for f in failures if f.round == last_round)


def _exception(failure: Result | None) -> BaseException | None:
    blob = failure.blob if failure is not None else None
    if not blob:
        return None
    try:  # it came in frames authenticated with the job's keys, from our own workers
        exc = cloudpickle.loads(blob)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None


def _final_values(members: list[WorkerRecord], functions: FunctionService) -> list[Any]:
    values: list[Any] = []
    for w in members:
        r = functions.result(w.id)
        blob = r.blob if r is not None and r.kind == "value" else None
        if blob is None:
            failure = r if r is not None and r.kind == "error" else None
            why = (words.reason(w.why) if w.why is not None else
                   f"exited with code {w.exit_code}" if w.exit_code is not None else "did not finish")
            raise RunError(f"The job finished, but rank {w.rank} ({w.label}) of its final round returned no "
                           f"value: it {why}.", 1, failure, functions.errors()) from _exception(failure)
        values.append(cloudpickle.loads(blob))
    return values


# --- the caller's process ------------------------------------------------------------------
@contextlib.contextmanager
def _driver_logging(level: str) -> Iterator[None]:
    """The driver's messages on the caller's stderr while the job runs (the root logger is left alone)."""
    logger = logging.getLogger("elasticrun")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[elasticrun] %(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _join_new_threads(before: set[threading.Thread], deadline: float) -> None:
    """Wait (bounded) for the job's helper threads to end, so none outlives ``run``.

    A discovery callable that never returns cannot be stopped: its thread is left as a daemon.
    """
    for t in threading.enumerate():
        if (t in before or t is threading.current_thread() or not t.name.startswith("elasticrun")
                or t.name == "elasticrun-discovery-call"):
            continue
        t.join(max(0.0, deadline - time.monotonic()))
