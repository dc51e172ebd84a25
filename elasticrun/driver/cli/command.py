"""``elasticrun``: the command line (flag names follow ``horovodrun``).

The flags themselves are ``parser.py``'s; here they are checked together and turned into
``JobSettings`` (``parse_settings``, also used by ``elasticrun.run()``), and ``main`` runs the
job, ``--check`` or ``elasticrun timeline``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import socket
import sys
from typing import Any, Callable, Mapping, NoReturn

from elasticrun.common.errors import JobFailed
from elasticrun.common.hosts import MAX_SLOTS_PER_HOST, HostSpecError, parse_hostfile, parse_hosts_arg
from elasticrun.common.paths import check_writable_dir, check_writable_file, obeyed_file_problem
from elasticrun.common.settings import DEFAULT_STALL_WARNING, JobSettings
from elasticrun.discovery.sources import FixedHosts, ScriptDiscovery, discovery_command
from elasticrun.driver import network
from elasticrun.driver.cli import check
from elasticrun.driver.durable import checkpoints
from elasticrun.driver.cli import config
from elasticrun.driver.cli.parser import (
    IGNORED_HOROVODRUN_FLAGS,
    ExitingParser,
    RaisingParser,
    build_parser,
    ignored_dest,
    read_hostfile,
)


Fail = Callable[[str], NoReturn]


def key_too_open(path: str) -> str:
    """ssh's rule for a private key of yours ("" if it holds): nobody else may read or write
    it. A key others can read is no longer a secret; ssh refuses it, and so does the job."""
    st = os.stat(path)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        return f"permissions {st.st_mode & 0o777:04o} are too open for a private key: chmod 600 {path}"
    return ""


def _remote_settings(o: Mapping[str, Any], fail: Fail) -> dict:
    extra_env: dict[str, str] = {}
    for item in o["env"]:
        name, eq, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            fail(f"-x {item}: {name!r} is not a valid environment variable name")
        if not eq:
            if name not in os.environ:
                fail(f"-x {name}: {name} is not set here (use -x {name}=VALUE to set it)")
            value = os.environ[name]
        extra_env[name] = value
    identity = o["ssh_identity_file"]
    if identity is not None:
        if not os.access(identity, os.R_OK):
            fail(f"-i {identity}: no such readable file")
        if not os.path.isfile(identity):  # a directory; a FIFO would block the SSH connection's read
            fail(f"-i {identity}: not a regular file")
        why = obeyed_file_problem(identity) or key_too_open(identity)
        if why:
            fail(f"-i {identity}: {why}")
        identity = os.path.abspath(identity)
    known = o["ssh_known_hosts"]
    if known is not None:
        if not os.access(known, os.R_OK):
            fail(f"--ssh-known-hosts {known}: no such readable file")
        if not os.path.isfile(known):
            fail(f"--ssh-known-hosts {known}: not a regular file")
        # It decides which servers get the job's keys and environment: someone else's choice
        # of it is as good as no host-key check.
        why = obeyed_file_problem(known)
        if why:
            fail(f"--ssh-known-hosts {known}: {why}")
        known = os.path.abspath(known)
    address, nic = o["driver_address"], o["network_interface"]
    if nic is not None:  # the driver listens on the first; gloo gets them all (GLOO_SOCKET_IFNAME)
        first = nic.split(",")[0]
        try:
            address = network.interface_address(first)
        except OSError as exc:
            fail(f"--network-interface {first}: {exc.strerror or exc}")
    elif address is not None:
        try:
            infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
            address = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0][4][0]
        except socket.gaierror as exc:
            fail(f"--driver-address {o['driver_address']}: {exc.strerror}")
    if address is not None:
        try:
            network.check_bindable(address)
        except OSError as exc:
            flag = f"--network-interface {nic}" if nic else f"--driver-address {address}"
            fail(f"{flag}: cannot listen on {address} here ({exc.strerror or exc})")
    return dict(
        extra_env=extra_env, launcher=o["launcher"], ssh_port=o["ssh_port"], ssh_user=o["ssh_user"],
        ssh_identity_file=identity, ssh_known_hosts=known, ssh_accept_unknown_hosts=o["ssh_accept_unknown_hosts"],
        remote_cwd=o["remote_cwd"], remote_python=o["remote_python"], forward_env=o["forward_env"],
        driver_address=address, network_interface=nic)


def python_script_command(command: list[str]) -> list[str]:
    """``train.py ...`` as torchrun runs it: with this Python (``elasticrun -np 2 train.py``
    would otherwise ask the OS to execute the file). Any other command is left as it is."""
    if command[0].endswith(".py") and not command[0].startswith("-"):
        return [sys.executable, *command]
    return list(command)


def settings_from_options(o: Mapping[str, Any], command: list[str], fail: Fail, *,
                          callable_discovery: bool = False) -> JobSettings:
    """Check options (argparse dests -> values, each already through its flag's validator) as
    a whole and make the job's settings; ``fail(message)`` does not return. The command line
    and ``elasticrun.run()`` both come here, so they accept and refuse the same things.

    With no host source, the job runs on ``localhost:NP`` as horovodrun's does.
    ``callable_discovery``: hosts come from ``elasticrun.run(discovery=callable)`` instead.
    """
    if not command:
        fail("missing the training command, e.g. `elasticrun -np 2 -H localhost:2 python train.py`")
    command = python_script_command(command)
    np = o["np"]
    if np is None:
        fail("the number of processes is required (-np N)")
    min_np = o["min_np"] if o["min_np"] is not None else np
    if min_np > np:
        fail(f"--min-np {min_np} is more than -np {np}")
    if o["max_np"] is not None and o["max_np"] < np:
        fail(f"--max-np {o['max_np']} is less than -np {np}")
    cooldown = o["blacklist_cooldown_range"]
    if cooldown and cooldown[0] > cooldown[1]:
        fail(f"--blacklist-cooldown-range {cooldown[0]:g} {cooldown[1]:g}: LOW is more than HIGH")
    slots = o["slots_per_host"]
    if slots > MAX_SLOTS_PER_HOST:
        fail(f"--slots-per-host {slots}: a host has at most {MAX_SLOTS_PER_HOST} slots")
    given = [f for f, d in (("-H", "hosts"), ("--hostfile", "hostfile"),
                            ("--host-discovery-script", "host_discovery_script"),
                            ("--ray-address", "ray_address")) if o.get(d) is not None]
    if len(given) > 1:
        fail(f"{given[0]} and {given[1]} cannot be used together: give one host source")
    fixed = None
    try:
        if o["hosts"] is not None:
            fixed = parse_hosts_arg(o["hosts"], slots)
        elif o["hostfile"] is not None:
            fixed = parse_hostfile(read_hostfile(o["hostfile"]), slots, o["hostfile"])
    except (HostSpecError, ValueError) as exc:
        fail(str(exc))
    script = o["host_discovery_script"]
    if script is not None:
        try:
            argv = discovery_command(script)
        except ValueError as exc:
            fail(f"--host-discovery-script {exc}")
        script = argv[0] if len(argv) == 1 else script  # a file: by its absolute path
    ray = _ray_settings(o, fail)  # --ray-address: hosts are the Ray cluster's nodes
    if fixed is None and script is None and not callable_discovery and not ray:
        fixed = {"localhost": np}  # horovodrun -np N python train.py: N processes here
    if fixed is not None and sum(fixed.values()) < np:
        fail(f"-np {np} needs {np} slots but the host list has {sum(fixed.values())}")
    # As with horovodrun (its _is_elastic): an elastic job (--min-np or a discovery script) uses
    # every usable slot up to --max-np (unbounded by default), and -np is what it starts with
    # and waits for; otherwise the job is -np processes, fault tolerant but never larger, and
    # --max-np alone changes nothing (a job that grew past -np would change the global batch
    # and every learning rate scaled by hvd.size()).
    elastic = o["min_np"] is not None or script is not None or callable_discovery or bool(ray)
    warnings: list[str] = []
    if o["max_np"] is not None and not elastic and o["max_np"] != np:
        warnings.append(f"--max-np {o['max_np']} has no effect without --min-np or a discovery script (as with "
                        f"horovodrun): the job is -np {np} processes; add --min-np to let it grow")
    max_np = o["max_np"] if elastic else np
    level = "DEBUG" if o["verbose"] else (o["log_level"] or "INFO")
    # Workers stay quiet (WARNING) unless the user asked for a level: their lines interleave
    # with the training output on the console.
    worker_level = "DEBUG" if o["verbose"] else (o["log_level"] or "WARNING")
    _check_output_paths(o, fail)
    horovodrun = _horovodrun_settings(o, fail)
    shutdown = o.get("stall_shutdown_s")
    warning = o.get("stall_warning_s") or min(DEFAULT_STALL_WARNING, o["collective_timeout"] / 2)
    if shutdown and o.get("stall_check") is not False and shutdown < warning:
        warnings.append(f"--stall-check-shutdown-time-seconds {shutdown} is below the stall warning time "
                        f"({warning:g} s): no collective stops for a stall (as with horovodrun); "
                        f"raise it or lower --stall-check-warning-time-seconds")
    return JobSettings(
        command=list(command), np=np, min_np=min_np, max_np=max_np, hosts=fixed, discovery_script=script,
        startup_warnings=tuple(warnings),
        slots_per_host=slots, discovery_interval=o["discovery_interval"],
        discovery_timeout=o["discovery_timeout"], reset_limit=o["reset_limit"],
        cooldown_range=tuple(cooldown) if cooldown else None,
        elastic_timeout=o["elastic_timeout"], start_timeout=o["start_timeout"],
        collective_timeout=o["collective_timeout"], heartbeat_timeout=o["heartbeat_timeout"],
        output_filename=o["output_filename"], events_file=o["events_file"],
        checkpoint_dir=os.path.abspath(o["checkpoint_dir"]) if o["checkpoint_dir"] else None,
        checkpoint_interval=o["checkpoint_interval"], fresh=o["fresh"], sigterm_grace=o["sigterm_grace"],
        backend=o["backend"], status_interval=o["status_interval"],
        evict_stragglers=o["evict_stragglers"], prefetch=o["prefetch"],
        log_level=level,
        worker_log_level=worker_level,
        warm_start=o["warm_start"], preload=tuple(o["preload"] or ()),
        **_remote_settings(o, fail), **ray, **horovodrun)


def _horovodrun_settings(o: Mapping[str, Any], fail: Fail) -> dict:
    """horovodrun's own flags (parser.add_horovodrun_arguments): MPI refused, the timeline and
    output timestamps kept, the engine's tuning flags listed for one warning."""
    for dest, flag in (("use_mpi", "--mpi"), ("use_jsrun", "--jsrun"), ("mpi_args", "--mpi-args"),
                       ("binding_args", "--binding-args")):
        if o.get(dest):
            fail(f"{flag}: elasticrun has no MPI; its workers always talk over gloo, started by elasticrun "
                 f"itself (drop {flag}, or use --gloo)")
    timeline = o.get("timeline_filename")
    if timeline is not None:
        try:
            check_writable_file(timeline, "--timeline-filename")
        except ValueError as exc:
            fail(str(exc))
        timeline = os.path.abspath(timeline)
    given = {flag: o.get(ignored_dest(flag)) for flag in IGNORED_HOROVODRUN_FLAGS}
    ignored = tuple(flag for flag, value in given.items() if value is not None and value is not False)  # 0 counts
    return dict(timeline_filename=timeline, timeline_mark_cycles=bool(o.get("timeline_mark_cycles")),
                prefix_output_with_timestamp=bool(o.get("prefix_output_with_timestamp")),
                ignored_horovodrun_flags=ignored, tcp_only=bool(o.get("use_tcp")),
                stall_check=o.get("stall_check"), stall_warning_s=o.get("stall_warning_s"),
                stall_shutdown_s=o.get("stall_shutdown_s"))


def _ray_settings(o: Mapping[str, Any], fail: Fail) -> dict:
    """--ray-address and what each worker needs of a node; {} without --ray-address. Ray is
    an optional extra: its absence is one line saying what to install (it is not imported here)."""
    address = o.get("ray_address")
    if address is None:
        return {}
    from elasticrun.discovery.ray_nodes import ray_missing

    missing = ray_missing()
    if missing:
        fail(f"--ray-address needs {' and '.join(missing)}, which is not installed: "
             f"pip install 'ray==2.60.0' 'pynacl>=1.5'")
    if o["launcher"] != "auto":
        fail(f"--launcher {o['launcher']} cannot be used with --ray-address: workers start through Ray")
    if address.startswith("ray://"):
        fail(f"--ray-address {address[:80]}: Ray Client addresses are not supported; run elasticrun on a node "
             f"of the cluster with --ray-address auto (docs/ray.md)")
    need = dict(o["ray_resources"], CPU=o["ray_cpus_per_worker"], GPU=o["ray_gpus_per_worker"])
    if not any(v > 0 for v in need.values()):
        fail("--ray-address: each worker must need some resource (--ray-cpus-per-worker, --ray-gpus-per-worker "
             "or --ray-resources), or a node would have unlimited slots")
    return dict(ray_address=address, ray_cpus_per_worker=o["ray_cpus_per_worker"],
                ray_gpus_per_worker=o["ray_gpus_per_worker"], ray_resources=dict(o["ray_resources"]))


def parse_settings(argv: list[str]) -> JobSettings:
    """The command line's settings; bad input exits 2 with one line."""
    parser = build_parser(ExitingParser, False)
    a = config.parse_args(parser, argv, probe_parser=build_parser(ExitingParser, False))
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    return settings_from_options(vars(a), command, parser.error)


def option_actions() -> dict[str, argparse.Action]:
    """Every option by its dest and by its long flag's name with underscores (``min_np``,
    ``elastic_timeout``, ``env``, ...): the keywords ``elasticrun.run`` accepts."""
    actions: dict[str, argparse.Action] = {}
    for action in build_parser(RaisingParser, False)._actions:
        if not action.option_strings or action.dest in ("help", "version", "check"):
            continue
        actions.setdefault(action.dest, action)
        for opt in action.option_strings:
            if opt.startswith("--"):
                actions.setdefault(opt[2:].replace("-", "_"), action)
    return actions


def settings_from_keywords(options: Mapping[str, Any], command: list[str], *,
                           callable_discovery: bool = False) -> JobSettings:
    """``elasticrun.run``'s settings from its keywords (named like the long flags, values of
    their Python types), each checked by its flag's validator, then as a whole exactly as the
    command line's; the config file and ``ELASTICRUN_*`` variables lie under them, as under
    flags. ValueError for a bad value, TypeError for an unknown keyword."""
    actions = option_actions()
    given: dict[str, Any] = {}
    for name, value in options.items():
        action = actions.get(name)
        if action is None:
            raise TypeError(f"run() got an unexpected keyword argument {name!r}")
        if value is None:
            continue
        given[action.dest] = _keyword_value(name, action, value)
    parser = build_parser(RaisingParser, False)
    values = {a.dest: a.default for a in parser._actions if a.option_strings}
    values.update(config.layered_defaults(parser, given))
    values.update(given)

    def fail(message: str) -> NoReturn:
        raise ValueError(message)
    return settings_from_options(values, command, fail, callable_discovery=callable_discovery)


def _keyword_value(name: str, action: argparse.Action, value: Any) -> Any:
    """A keyword's value as its option's, through the flag's validator."""
    if action.dest == "hosts" and not isinstance(value, str):  # {"h1": 2} or ["h1:2", "h2"]
        value = (",".join(f"{h}:{s}" for h, s in value.items()) if isinstance(value, Mapping)
                 else ",".join(map(str, value)))
    elif isinstance(action, argparse._AppendAction):  # -x NAME[=VALUE]: a dict, a list or one string
        value = ([f"{k}={v}" for k, v in value.items()] if isinstance(value, Mapping)
                 else [value] if isinstance(value, str) else [str(v) for v in value])
    elif action.dest == "ray_resources" and isinstance(value, Mapping):  # {"trainer": 1}
        value = json.dumps(dict(value))
    elif action.nargs == 2 and isinstance(value, tuple):
        value = list(value)
    named_by_flag = action.dest != name and isinstance(action, argparse._StoreFalseAction)
    try:
        return config.convert_value(action, value, named_by_flag)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{name}={value!r}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{name}= must be {exc}, got {value!r}") from None


def _check_output_paths(o: Mapping[str, Any], fail: Fail) -> None:
    """Every path the job will write, checked before anything starts (creating missing
    directories as the job would): one line naming the flag, not a traceback mid-job."""
    try:
        if o["output_filename"] is not None:
            check_writable_dir(o["output_filename"], "--output-filename")
            if o["events_file"] is None:  # the job's event log goes there too
                check_writable_file(os.path.join(o["output_filename"], "events.jsonl"), "--output-filename")
        if o["events_file"] is not None:
            check_writable_file(o["events_file"], "--events")
        if o["checkpoint_dir"] is not None:  # the user's alone (0700 when made here): see docs/security.md
            checkpoints.check_directory(o["checkpoint_dir"], "--checkpoint-dir")
    except ValueError as exc:
        fail(str(exc))


def hold_standard_fds() -> None:
    """Put /dev/null on a standard descriptor the driver was started without (``>&-``, a
    daemon's closed stdout). Python leaves ``sys.stdout`` None then, which the output sink
    takes as a console that is gone; but the descriptor's number would go to the next file
    or socket the driver opens, and whatever writes to fd 1 (a child that inherits it, a
    C library's message) would write into that file or socket instead."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def main(argv: list[str] | None = None) -> int:
    hold_standard_fds()
    argv = sys.argv[1:] if argv is None else argv
    if check.wants_check(argv):
        return check.main(argv)
    settings = parse_settings(argv)
    from elasticrun.driver import console
    from elasticrun.driver.compose import job_parts
    from elasticrun.driver.driver import ElasticDriver

    # Every line through one writer thread: a console nobody reads must not stop the driver's loop.
    out = console.Console({"stdout": sys.stdout, "stderr": sys.stderr})
    handler = console.ConsoleHandler(out)
    handler.setFormatter(logging.Formatter("[elasticrun] %(message)s"))
    logging.basicConfig(level=settings.log_level, handlers=[handler])
    console.install(out)
    try:
        with contextlib.ExitStack() as stack:
            source, launcher = job_parts(settings, stack)
            return ElasticDriver(settings, source, launcher).run()
    except JobFailed as exc:
        out.close()
        if sys.stderr is not None:  # started with stderr closed: nobody to tell
            sys.stderr.write(f"elasticrun: {exc}\n")
        return exc.exit_code
    finally:
        out.close()
        console.install(None)
        logging.getLogger().removeHandler(handler)
