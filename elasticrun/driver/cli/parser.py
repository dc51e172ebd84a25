"""The ``elasticrun`` argument parser: every flag, its help and its validators.

One parser for the command line, ``--check`` (``check.py``), the TOML file and environment
layers under the flags (``config.py``) and ``elasticrun.run()`` (through ``cli.parse_settings``),
so that all of them accept and refuse the same input with the same message. It only parses:
turning the arguments into ``JobSettings`` is ``cli.parse_settings``'s job.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from elasticrun.common.paths import obeyed_file_problem, read_bounded
from elasticrun.common.settings import (
    DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_DISCOVERY_INTERVAL,
    DEFAULT_DISCOVERY_TIMEOUT,
    DEFAULT_ELASTIC_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_SIGTERM_GRACE,
    DEFAULT_START_TIMEOUT,
    DEFAULT_STATUS_INTERVAL,
)
from elasticrun.common.version import VERSION

DESCRIPTION = """\
Run COMMAND as an elastic, fault-tolerant data-parallel job.

Hosts come from a discovery script (run every --discovery-interval; it prints one `host` or
`host:slots` per line) or from a fixed list (-H / --hostfile, elastic for failures only).
Workers that fail are restarted nowhere: their host is blacklisted and the survivors carry
on from their last commit, in the same processes, once at least --min-np slots are usable.
"""

EPILOG = """\
exit status: 0 when the job succeeds; 1 when it fails (the reason is printed); 2 for bad
arguments or a misconfigured discovery script; 128+N when stopped by signal N.

example:
  elasticrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover_hosts.sh python train.py

also: elasticrun timeline EVENTS.jsonl [-o FILE.svg] draws a job's event log (elasticrun timeline --help)
"""


def log_level_name(value: str) -> str:
    """A level name, upper-cased; horovodrun's TRACE and FATAL map to logging's names."""
    value = value.upper()
    return {"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(value, value)


#: Counts above this (-np 99999999999999999999) are typos, refused rather than waited for.
MAX_COUNT = 1_000_000
#: A hostfile is a list of hosts: more than this is not one (--hostfile /dev/zero).
MAX_HOSTFILE_BYTES = 1 << 20


def positive_int(text: str) -> int:
    """A count of at least 1 (-np, slots, ports), at most MAX_COUNT."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} must be at most {MAX_COUNT:,}")
    return value


def non_negative_int(text: str) -> int:
    """A count that may be 0 (--reset-limit)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if not 0 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} must be between 0 and {MAX_COUNT:,}")
    return value


#: The longest duration any option takes (a week): every timeout and interval must be a
#: finite number the clocks, timers and gloo's millisecond timeouts can hold (1e12 s overflowed them).
MAX_SECONDS = 7 * 24 * 3600


def positive_seconds(text: str) -> float:
    """A duration of more than 0 seconds, at most MAX_SECONDS (every timeout and interval)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
    if not 0 < value <= MAX_SECONDS:  # also refuses inf and nan
        raise argparse.ArgumentTypeError(f"{text[:40]!r} must be more than 0 and at most {MAX_SECONDS:,} seconds "
                                         f"(7 days)")
    return value


def backend_name(text: str) -> str:
    """--backend: auto, gloo or nccl (any case: Horovod's HOROVOD_GPU_OPERATIONS=NCCL)."""
    value = text.strip().lower()
    if value == "mpi":
        raise argparse.ArgumentTypeError("elasticrun has no MPI: CUDA tensors go over nccl or gloo")
    if value not in ("auto", "gloo", "nccl"):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} must be auto, gloo or nccl")
    return value


def seconds_or_zero(text: str) -> float:
    """A duration of 0 (off) up to MAX_SECONDS (--status-interval)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
    if not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} must be 0 (off) or up to {MAX_SECONDS:,} seconds (7 days)")
    return value


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} must be a port number from 1 to 65535")
    return value


def non_negative_number(text: str) -> float:
    """An amount that may be 0 or fractional (a worker's share of a Ray node: 0.5 GPU)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not 0 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} must be between 0 and {MAX_COUNT:,}")
    return value


def ray_resources(text: str) -> dict[str, float]:
    """--ray-resources: a JSON object of Ray custom resources per worker, e.g. '{"trainer": 1}'."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not JSON (e.g. '{{\"trainer\": 1}}')") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not a JSON object of resource names and amounts")
    out: dict[str, float] = {}
    for name, amount in value.items():
        if name in ("CPU", "GPU"):
            raise argparse.ArgumentTypeError(f"{name}: use --ray-{name.lower()}s-per-worker")
        if not name or isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 <= amount <= MAX_COUNT:
            raise argparse.ArgumentTypeError(f"{name!r:.60}: {amount!r:.40} is not an amount (a number, 0 or more)")
        out[name] = float(amount)
    return out


class ExitingParser(argparse.ArgumentParser):
    """For the command line: a bad argument is one line and exit status 2."""

    def error(self, message: str) -> NoReturn:  # one line a user can act on, exit 2
        self.exit(2, f"elasticrun: error: {message} (see elasticrun --help)\n")


class RaisingParser(ExitingParser):
    """For ``elasticrun.run()``: the same checks and messages, raised as ValueError."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def build_parser(parser_class: type[argparse.ArgumentParser] = ExitingParser,
                 host_source_required: bool = True) -> argparse.ArgumentParser:
    """The parser of every ``elasticrun`` option; ``host_source_required=False`` lets a job run
    without -H/--hostfile/--host-discovery-script (localhost:NP, or a callable's hosts)."""
    p = parser_class(prog="elasticrun", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--version", action="version", version=f"elasticrun {VERSION}")
    p.add_argument("--check", "-cb", "--check-build", action="store_true",
                   help="check this installation (torch, gloo/NCCL, pyzmq, paramiko, cloudpickle) and that "
                        "each host of -H/--hostfile/--host-discovery-script is reachable (SSH, python, torch); "
                        "no training command needed; exit 0 when all is well, 1 otherwise")
    p.add_argument("--config-file", metavar="FILE",
                   help="TOML file of options (keys are long option names, e.g. min-np = 2); "
                        "flags override ELASTICRUN_* environment variables, which override the file "
                        "(see docs/configuration.md)")
    p.add_argument("-np", "--num-proc", dest="np", type=positive_int, required=True,
                   help="number of processes to start with (the first round waits for this many slots; from "
                        "discovery, up to --elastic-timeout, then starts with --min-np or more)")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=positive_int,
                   help="fewest processes to keep training with (default: -np)")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=positive_int,
                   help="most processes to use. As with horovodrun, an elastic job (--min-np or a discovery "
                        "script given) uses every usable slot up to MAX, unbounded by default; otherwise the job "
                        "is -np processes (and --max-np alone changes nothing)")
    hosts = p.add_mutually_exclusive_group(required=host_source_required)
    hosts.add_argument("--host-discovery-script", metavar="PATH",
                       help="executable printing the usable hosts, one `host[:slots]` per line (or, as "
                            "with horovodrun, a command line run by /bin/sh: \"python discover.py --zone a\")")
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="fixed host list, e.g. localhost:2,127.0.0.1:2")
    hosts.add_argument("--hostfile", "-hostfile", metavar="FILE", help="file with one `host[:slots]` or `host slots=N` per line")
    hosts.add_argument("--ray-address", metavar="ADDRESS",
                       help="run on a Ray cluster: its nodes are the hosts (slots from their free resources), "
                            "workers start through Ray; `auto` joins the cluster this machine belongs to "
                            "(needs pip install 'ray==2.60.0' 'pynacl>=1.5'; see docs/ray.md)")
    p.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=positive_int, default=1,
                   help="slots for hosts listed without a count (default 1)")
    p.add_argument("--discovery-interval", type=positive_seconds, default=DEFAULT_DISCOVERY_INTERVAL, metavar="SECONDS",
                   help="how often to run the discovery script (default 1)")
    p.add_argument("--discovery-timeout", type=positive_seconds, default=DEFAULT_DISCOVERY_TIMEOUT, metavar="SECONDS",
                   help="a discovery run taking longer is killed and counts as failed (default 10)")
    p.add_argument("--reset-limit", type=non_negative_int, metavar="N",
                   help="fail the job instead of doing reset number N+1 (default: unlimited)")
    p.add_argument("--blacklist-cooldown-range", type=positive_seconds, nargs=2, metavar=("LOW", "HIGH"),
                   help="let blacklisted hosts back after a cooldown that doubles on every failure, "
                        "between LOW and HIGH seconds (default: blacklisting is permanent)")
    p.add_argument("--evict-stragglers", action="store_true",
                   help="a host whose workers compute persistently slower than the other hosts' (over 1.5x "
                        "their median for most of the last 20 steps) is always named; with this it is also moved "
                        "out at the next commit, without a rollback, and blacklisted like a failed host (so "
                        "--blacklist-cooldown-range lets it back later); never below --min-np")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="a worker joining the running job receives the whole state in the sync that admits it, "
                        "while every survivor waits; by default it first fetches rank 0's committed model while "
                        "they train, and that sync sends only what changed since (also ELASTICRUN_PREFETCH=0)")
    p.add_argument("--elastic-timeout", type=positive_seconds, default=DEFAULT_ELASTIC_TIMEOUT, metavar="SECONDS",
                   help="how long to wait for slots before failing: --min-np after a reset, -np for the first "
                        "round when hosts come from discovery (which then starts with --min-np slots or more "
                        "if it has them) (default 600)")
    p.add_argument("--start-timeout", type=positive_seconds, default=DEFAULT_START_TIMEOUT, metavar="SECONDS",
                   help="how long a started worker may take to contact the driver, and how long the first "
                        "round waits for -np slots of a fixed host list (default 30; slots from discovery: "
                        "--elastic-timeout, as horovodrun)")
    p.add_argument("--collective-timeout", "--gloo-timeout-seconds", type=positive_seconds,
                   default=DEFAULT_COLLECTIVE_TIMEOUT, metavar="SECONDS",
                   help="a collective waiting longer for its peers raises HorovodInternalError in the worker "
                        "(default 1800, as torch.distributed's; a peer's death is heard at once whatever this "
                        "says, and a long wait is said after 60 s)")
    p.add_argument("--heartbeat-timeout", type=positive_seconds, default=DEFAULT_HEARTBEAT_TIMEOUT, metavar="SECONDS",
                   help="a worker that sends no heartbeat for this long (hung, stopped, off the network) "
                        "is killed and its host handled as failed (default 5)")
    p.add_argument("--backend", type=backend_name, default="auto", metavar="{auto,gloo,nccl}",
                   help="what carries CUDA tensors: nccl (one GPU per worker; CPU tensors and the job's "
                        "agreements stay on gloo), gloo (through host memory), or auto (default: nccl when "
                        "every host of a round has a GPU per worker and NCCL, else gloo). Also "
                        "HOROVOD_GPU_OPERATIONS=NCCL (see docs/gpu.md)")
    p.add_argument("--status-interval", type=seconds_or_zero, default=DEFAULT_STATUS_INTERVAL, metavar="SECONDS",
                   help="while a round trains or resets, a status line this often: round, workers and hosts (and "
                        "new workers still starting or joining), steps and steps/s, resets, the age of the last "
                        "commit and of the durable copy (default 60; 0: never)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also append each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--events", metavar="FILE", dest="events_file",
                   help="append the job's event log (JSON lines: discovery, failures, rounds, each "
                        "worker's reset phases) to FILE (default: DIR/events.jsonl with --output-filename)")
    d = p.add_argument_group("durable copies", "Keep the newest commit on this machine's disk, so that the job "
                             "survives losing every worker, or this driver (run the same command again).")
    d.add_argument("--checkpoint-dir", metavar="DIR",
                   help="write a durable copy of the newest commit to DIR (on this machine) every "
                        "--checkpoint-interval; a job started with DIR holding one resumes from it")
    d.add_argument("--checkpoint-interval", type=positive_seconds, default=DEFAULT_CHECKPOINT_INTERVAL, metavar="SECONDS",
                   help="how old the durable copy may get, at most (default 60)")
    d.add_argument("--fresh", action="store_true",
                   help="start from the script's own state even if --checkpoint-dir holds a durable copy")
    d.add_argument("--sigterm-grace", type=positive_seconds, default=DEFAULT_SIGTERM_GRACE, metavar="SECONDS",
                   help="a worker that receives SIGTERM leaves gracefully (its host is moved out at the next "
                        "step); it is stopped anyway after this long, or at a second SIGTERM (default 20)")
    p.add_argument("--log-level", default=None, type=log_level_name,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="driver and worker log level (default INFO for the driver's job messages; "
                        "horovodrun's TRACE and FATAL mean DEBUG and CRITICAL)")
    p.add_argument("--verbose", action="store_true", help="same as --log-level DEBUG")
    add_remote_arguments(p)
    add_warm_start_arguments(p)
    add_ray_arguments(p)
    add_horovodrun_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")
    return p


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """The options of launching on other machines (SSH, environment, driver address)."""
    g = p.add_argument_group("other machines (SSH)", "Hosts that are not this machine run their workers over "
                             "SSH; the remote side needs the same Python environment and a `python3`.")
    g.add_argument("--launcher", choices=["auto", "local", "ssh"], default="auto",
                   help="auto (default): SSH for hosts that are not this machine and for user@host names, "
                        "child processes otherwise; local: never SSH; ssh: always SSH, even to this machine")
    g.add_argument("-p", "--ssh-port", type=port, default=22, metavar="PORT", help="SSH port (default 22)")
    g.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                   help="private key to log in with (tried first; then the SSH agent and ~/.ssh keys)")
    g.add_argument("--ssh-user", metavar="USER", help="remote user for hosts without user@ (default: yours)")
    g.add_argument("--ssh-known-hosts", metavar="FILE",
                   help="known_hosts file with the hosts' keys (default ~/.ssh/known_hosts); "
                        "a host whose key is missing or different is refused")
    g.add_argument("--ssh-accept-unknown-hosts", action="store_true",
                   help="connect to hosts whose key is not in known_hosts without checking it (a changed key "
                        "is still refused). RISK: whoever answers for a host name (DNS spoofing, a "
                        "man in the middle) receives the job's secret and the workers' environment (with "
                        "any credentials in it) and can send the driver forged worker messages; use it "
                        "only on a network you trust")
    g.add_argument("--remote-cwd", metavar="DIR",
                   help="working directory of remote workers (default: the directory elasticrun runs in)")
    g.add_argument("--remote-python", default="python3", metavar="PATH",
                   help="Python 3 on the remote hosts that runs elasticrun's small launcher and watchdog "
                        "(default python3, looked up on the remote login PATH)")
    g.add_argument("-x", "--env", dest="env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="give every worker NAME (its value here) or NAME=VALUE; repeatable")
    g.add_argument("--no-forward-env", dest="forward_env", action="store_false",
                   help="remote workers get only their remote login environment plus the -x variables, "
                        "instead of this environment (as horovodrun forwards it)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--driver-address", metavar="ADDR",
                       help="address of this machine that workers connect to (default: for each host, the "
                            "address this machine uses to reach it; 127.0.0.1 for local workers)")
    where.add_argument("--network-interface", "--network-interfaces", type=interface_list, action=_AddInterfaces,
                       metavar="NIC[,NIC...]",
                       help="use the IPv4 address of interface NIC (the first) as --driver-address; also sets "
                            "GLOO_SOCKET_IFNAME=NIC[,NIC...] for the workers unless it is set (repeatable)")


def interface_list(text: str) -> str:
    """``NIC[,NIC...]``: network interface names, comma-joined (horovodrun's --network-interfaces)."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if len(n) > 15 or not all(c.isalnum() or c in "._-:@" for c in n)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{(bad or [text])[0][:60]!r} is not a network interface name (NIC[,NIC...])")
    return ",".join(names)


class _AddInterfaces(argparse.Action):
    """``--network-interface eth0 --network-interface eth1``: both, as horovodrun takes them."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        have = [n for n in (getattr(namespace, self.dest, None) or "").split(",") if n]
        setattr(namespace, self.dest, ",".join(have + [n for n in values.split(",") if n not in have]))


def module_list(text: str) -> tuple[str, ...]:
    """``MOD[,MOD...]``: dotted module names (--preload)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if not all(part.isidentifier() for part in n.split("."))]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{(bad or [text])[0][:60]!r} is not a module name (MOD[,MOD...])")
    return names


class _AddModules(argparse.Action):
    """``--preload A,B --preload C``: every module named, in order (each flag adds to the list)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        have = tuple(getattr(namespace, self.dest, None) or ())
        setattr(namespace, self.dest, have + tuple(n for n in values if n not in have))


def add_warm_start_arguments(p: argparse.ArgumentParser) -> None:
    """Warm worker start: workers forked from a per-host template (elasticrun/worker/template.py)."""
    g = p.add_argument_group("warm worker start", "Workers running `python script.py` or `python -m module` are "
                             "forked from a process per host that has imported torch and elasticrun already, "
                             "instead of starting a new interpreter (see docs/configuration.md).")
    g.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                   help="start every worker as a new process (also ELASTICRUN_WARM_START=0)")
    g.add_argument("--preload", type=module_list, action=_AddModules, default=(), metavar="MOD[,MOD...]",
                   help="modules the templates also import before forking workers, e.g. transformers "
                        "(repeatable)")
def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """What each worker needs of a Ray node (with --ray-address): a node has as many slots as
    its free resources fit workers."""
    g = p.add_argument_group("Ray cluster (--ray-address)", "What each worker needs of a node; a node has as many "
                             "slots as its free resources (plus those the job's own workers hold) fit.")
    g.add_argument("--ray-cpus-per-worker", type=non_negative_number, default=1.0, metavar="N",
                   help="CPUs Ray reserves for each worker (default 1)")
    g.add_argument("--ray-gpus-per-worker", type=non_negative_number, default=0.0, metavar="N",
                   help="GPUs Ray reserves for each worker (default 0); a worker sees the GPUs Ray gives it")
    g.add_argument("--ray-resources", type=ray_resources, default={}, metavar="JSON",
                   help='custom Ray resources each worker needs, e.g. \'{"trainer": 1}\'')


def read_hostfile(path: str) -> str:
    """The text of a hostfile, read with a limit (``--hostfile /dev/zero`` is one line, not a
    hang); ValueError naming the flag and the reason."""
    why = obeyed_file_problem(path)
    if why:
        raise ValueError(f"--hostfile {path}: {why}")
    try:
        raw = read_bounded(path, MAX_HOSTFILE_BYTES)
    except OSError as exc:
        raise ValueError(f"--hostfile {path}: {exc.strerror or exc}") from None
    text = raw.decode("utf-8", errors="replace")
    if len(raw) > MAX_HOSTFILE_BYTES:
        raise ValueError(f"--hostfile {path}: more than 1 MiB, not a list of hosts")
    return text


#: horovodrun's tuning flags for Horovod's own engine (tensor fusion, the response cache,
#: autotuning, hierarchical algorithms, MPI/NCCL threads, log timestamps):
#: accepted so that a horovodrun command line runs unchanged, and named once in a warning,
#: since there is nothing here they could tune. flag -> type of its value (None: no value).
IGNORED_HOROVODRUN_FLAGS: dict[str, Any] = {
    "--fusion-threshold-mb": non_negative_int, "--cycle-time-ms": non_negative_number,
    "--cache-capacity": non_negative_int,
    "--hierarchical-allreduce": None, "--no-hierarchical-allreduce": None,
    "--hierarchical-allgather": None, "--no-hierarchical-allgather": None,
    "--autotune": None, "--no-autotune": None, "--autotune-log-file": str,
    "--autotune-warmup-samples": non_negative_int, "--autotune-steps-per-sample": non_negative_int,
    "--autotune-bayes-opt-max-samples": non_negative_int, "--autotune-gaussian-process-noise": non_negative_number,
    "--mpi-threads-disable": None, "--no-mpi-threads-disable": None,
    "--num-nccl-streams": non_negative_int, "--ccl-bgt-affinity": non_negative_int,
    "--thread-affinity": non_negative_int,
    "--log-with-timestamp": None, "--log-without-timestamp": None,
    "--log-hide-timestamp": None, "--no-log-hide-timestamp": None,
}


def ignored_dest(flag: str) -> str:
    """The argparse dest of an ignored horovodrun flag (``--cycle-time-ms`` -> ``hvd_cycle_time_ms``)."""
    return "hvd_" + flag[2:].replace("-", "_")


def add_horovodrun_arguments(p: argparse.ArgumentParser) -> None:
    """horovodrun's flags that have no counterpart of their own: the controller flags, the
    timeline, output timestamps, and the tuning flags of Horovod's engine (ignored, named once)."""
    g = p.add_argument_group(
        "horovodrun command lines",
        "A horovodrun command line runs unchanged. --gloo and --disable-cache change nothing (workers "
        "always talk over gloo, on TCP; nothing is cached); --tcp keeps NCCL on TCP too (NCCL_IB_DISABLE=1); --mpi, --jsrun, --mpi-args and --binding-args are "
        "refused (there is no MPI here). Horovod's engine tuning flags (" + ", ".join(
            f for f in IGNORED_HOROVODRUN_FLAGS if not f.startswith("--no-")) + ") are accepted and named in "
        "one warning: nothing here uses them (see docs/porting-from-horovod.md).")
    g.add_argument("--gloo", dest="use_gloo", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--tcp", dest="use_tcp", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--disable-cache", dest="disable_cache", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--mpi", dest="use_mpi", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--jsrun", dest="use_jsrun", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--mpi-args", dest="mpi_args", metavar="ARGS", help=argparse.SUPPRESS)
    g.add_argument("--binding-args", dest="binding_args", metavar="ARGS", help=argparse.SUPPRESS)
    g.add_argument("--timeline-filename", metavar="FILE",
                   help="record a Chrome trace of rank 0's collectives into FILE (written as it goes, on rank "
                        "0's host), as hvd.start_timeline(FILE) in every worker would")
    g.add_argument("--timeline-mark-cycles", action="store_true",
                   help="with --timeline-filename: also mark every state.commit() on it")
    g.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_false", default=False,
                   help=argparse.SUPPRESS)
    g.add_argument("--prefix-output-with-timestamp", "-prefix-timestamp", dest="prefix_output_with_timestamp",
                   action="store_true", help="start each line of the workers' output on the console with the time")
    g.add_argument("--no-stall-check", dest="stall_check", action="store_false", default=None,
                   help="no warning about a collective that waits long for other ranks (Horovod's stall check)")
    g.add_argument("--stall-check", dest="stall_check", action="store_true", default=None, help=argparse.SUPPRESS)
    g.add_argument("--stall-check-warning-time-seconds", dest="stall_warning_s", type=positive_int,
                   metavar="S", help="warn when a collective has waited S s for other ranks (60, or half "
                                     "--collective-timeout if shorter), naming the ranks in no collective, "
                                     "then every 5 minutes")
    g.add_argument("--stall-check-shutdown-time-seconds", dest="stall_shutdown_s", type=non_negative_int,
                   metavar="S", help="a collective that waited S s for other ranks raises HorovodInternalError "
                                     "on every rank, as one past --collective-timeout (0, the default: never; "
                                     "not below the warning time)")
    for flag, kind in IGNORED_HOROVODRUN_FLAGS.items():
        if kind is None:
            g.add_argument(flag, dest=ignored_dest(flag), action="store_true", help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, dest=ignored_dest(flag), type=kind, metavar="VALUE", help=argparse.SUPPRESS)
