"""Settings of one elastic job, validated once by the CLI and then read everywhere else.

The defaults of the timing settings are module constants, the one source for
:class:`JobSettings` and for the worker, which falls back to them when the driver's
environment does not set a value (a worker started by hand).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_DISCOVERY_INTERVAL = 1.0
DEFAULT_DISCOVERY_TIMEOUT = 10.0
DEFAULT_ELASTIC_TIMEOUT = 600.0
DEFAULT_START_TIMEOUT = 30.0
#: A collective's longest wait for its peers. Long, as torch.distributed's 30 minutes: a peer's
#: death is heard from the driver in milliseconds, whatever this says; what waits here is a rank
#: busy outside collectives (evaluating or saving alone while the others wait in a barrier, as
#: Horovod scripts do), which Horovod lets run as long as it takes. (It was 60 s: a rank-0-only
#: evaluation of a minute failed the job, or reset it again and again under elastic.run.)
DEFAULT_COLLECTIVE_TIMEOUT = 1800.0
#: Horovod's stall check: a collective waiting this long for other ranks says so (or after half
#: the collective timeout, if shorter), unless --stall-check-warning-time-seconds says otherwise.
DEFAULT_STALL_WARNING = 60.0
DEFAULT_HEARTBEAT_INTERVAL = 0.5
DEFAULT_HEARTBEAT_TIMEOUT = 5.0  # a worker silent this long is declared hung and killed
DEFAULT_DRIVER_TIMEOUT = 5.0  # a worker that hears nothing from the driver this long exits
DEFAULT_STOP_GRACE = 5.0  # SIGTERM -> SIGKILL delay when stopping workers
DEFAULT_CHECKPOINT_INTERVAL = 60.0  # how old a durable copy may get
DEFAULT_SIGTERM_GRACE = 20.0  # a worker told to stop leaves gracefully within this
DEFAULT_STATUS_INTERVAL = 60.0  # a quiet job still says it is alive, and how it goes
STRAGGLER_WINDOW = 20  # steps: workers report medians over this many, the driver compares full windows


def elastic_wait_limit(elastic_timeout: float, start_timeout: float) -> float:
    """How long a worker may wait for its next round before giving up on the driver: the
    driver's own wait for slots, a newcomer's start, and a minute of slack."""
    return elastic_timeout + start_timeout + 60.0


#: What a worker started without the driver's environment waits for a round.
DEFAULT_RENDEZVOUS_TIMEOUT = elastic_wait_limit(DEFAULT_ELASTIC_TIMEOUT, DEFAULT_START_TIMEOUT)


@dataclass(frozen=True)
class JobSettings:
    command: list[str]
    np: int
    min_np: int
    max_np: int | None  # None: as many slots as discovery offers
    hosts: dict[str, int] | None = None  # fixed host list (-H / --hostfile)
    discovery_script: str | None = None
    slots_per_host: int = 1
    discovery_interval: float = DEFAULT_DISCOVERY_INTERVAL
    discovery_timeout: float = DEFAULT_DISCOVERY_TIMEOUT
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None
    elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT
    start_timeout: float = DEFAULT_START_TIMEOUT
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    driver_timeout: float = DEFAULT_DRIVER_TIMEOUT
    stop_grace: float = DEFAULT_STOP_GRACE
    output_filename: str | None = None
    events_file: str | None = None  # JSON-lines event log (default: OUTPUT_FILENAME/events.jsonl)
    checkpoint_dir: str | None = None  # durable copies of the newest commit (driver's disk)
    checkpoint_interval: float = DEFAULT_CHECKPOINT_INTERVAL  # how old the durable copy may get
    fresh: bool = False  # ignore durable copies already in checkpoint_dir
    backend: str = "auto"  # what carries CUDA tensors: auto (NCCL where every worker has a GPU), gloo, nccl
    status_interval: float = DEFAULT_STATUS_INTERVAL  # a status line this often while a round trains (0: never)
    sigterm_grace: float = DEFAULT_SIGTERM_GRACE  # a worker told to stop leaves gracefully, at most this long
    evict_stragglers: bool = False  # move hosts that compute persistently slower out (and blacklist them)
    prefetch: bool = True  # --no-prefetch: newcomers receive the whole state in the join's sync
    log_level: str = "INFO"
    worker_log_level: str = "WARNING"
    extra_env: dict[str, str] = field(default_factory=dict)  # -x NAME[=VALUE], for every worker
    # Launching on other machines (elasticrun/driver/launch/launchers.py, ssh.py, network.py, environment.py).
    launcher: str = "auto"  # auto | local | ssh
    ssh_port: int = 22
    ssh_user: str | None = None  # default: the current user (or user@host)
    ssh_identity_file: str | None = None
    ssh_known_hosts: str | None = None  # default: ~/.ssh/known_hosts
    ssh_accept_unknown_hosts: bool = False
    remote_cwd: str | None = None  # default: the driver's working directory
    remote_python: str = "python3"  # runs the remote bootstrap/watchdog
    forward_env: bool = True  # remote workers get the driver's environment (as horovodrun does)
    driver_address: str | None = None  # --driver-address, or the address of --network-interface
    network_interface: str | None = None
    # Warm worker start (elasticrun/worker/template.py): fork workers from a per-host template.
    warm_start: bool = True  # --no-warm-start: every worker a new process
    preload: tuple[str, ...] = ()  # --preload: modules the templates import besides torch and elasticrun
    # On a Ray cluster (elasticrun/discovery/ray_nodes.py, driver/launch/ray_launcher.py): hosts are its
    # nodes, workers start through Ray; what each worker needs of a node's resources.
    ray_address: str | None = None  # --ray-address: "auto" or the cluster's address
    ray_cpus_per_worker: float = 1.0
    ray_gpus_per_worker: float = 0.0
    ray_resources: dict[str, float] = field(default_factory=dict)  # custom resources per worker
    # horovodrun's own flags (driver/cli/parser.py add_horovodrun_arguments).
    timeline_filename: str | None = None  # --timeline-filename: rank 0's Chrome trace (HOROVOD_TIMELINE)
    timeline_mark_cycles: bool = False
    prefix_output_with_timestamp: bool = False  # the console's worker lines start with the time
    ignored_horovodrun_flags: tuple[str, ...] = ()  # Horovod engine tuning flags given: named in one warning
    tcp_only: bool = False  # horovodrun's --tcp: NCCL too keeps to TCP (NCCL_IB_DISABLE=1)
    # horovodrun's stall check, passed to the workers as Horovod's variables (its set_env_from_args):
    stall_check: bool | None = None  # --stall-check / --no-stall-check (None: the environment's, else on)
    stall_warning_s: int | None = None  # --stall-check-warning-time-seconds (None: 60, or half the collective timeout)
    stall_shutdown_s: int | None = None  # --stall-check-shutdown-time-seconds (0: never)
    startup_warnings: tuple[str, ...] = ()  # what the options meant that the user may not expect: said at start

    @property
    def elastic(self) -> bool:
        """Whether the job may change size (hosts from discovery, or --min-np/--max-np other
        than -np): horovodrun's sense of an elastic job."""
        return self.hosts is None or self.min_np != self.np or self.max_np != self.np

    @property
    def elastic_wait_limit(self) -> float:
        """How long a worker may wait for its next round before giving up on the driver."""
        return elastic_wait_limit(self.elastic_timeout, self.start_timeout)
