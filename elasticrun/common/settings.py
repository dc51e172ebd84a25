"""Settings of one elastic job, validated once by the CLI and then read everywhere else."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class JobSettings:
    command: list[str]
    np: int
    min_np: int
    max_np: int | None  # None: as many slots as discovery offers
    hosts: dict[str, int] | None = None  # fixed host list (-H / --hostfile)
    discovery_script: str | None = None
    slots_per_host: int = 1
    discovery_interval: float = 1.0
    discovery_timeout: float = 10.0
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None
    elastic_timeout: float = 600.0
    start_timeout: float = 30.0
    collective_timeout: float = 60.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0  # a worker silent this long is declared hung and killed
    driver_timeout: float = 5.0  # a worker that hears nothing from the driver this long exits
    stop_grace: float = 5.0  # SIGTERM -> SIGKILL delay when stopping workers
    output_filename: str | None = None
    events_file: str | None = None  # JSON-lines event log (default: OUTPUT_FILENAME/events.jsonl)
    checkpoint_dir: str | None = None  # durable copies of the newest commit (driver's disk)
    checkpoint_interval: float = 60.0  # how old the durable copy may get
    fresh: bool = False  # ignore durable copies already in checkpoint_dir
    sigterm_grace: float = 20.0  # a worker told to stop leaves gracefully, at most this long
    log_level: str = "INFO"
    worker_log_level: str = "WARNING"
    extra_env: dict[str, str] = field(default_factory=dict)  # -x NAME[=VALUE], for every worker
    # Launching on other machines (elasticrun/driver/launchers.py, ssh.py, network.py, environment.py).
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

    @property
    def elastic_wait_limit(self) -> float:
        """How long a worker may wait for its next round before giving up on the driver."""
        return self.elastic_timeout + self.start_timeout + 60.0
