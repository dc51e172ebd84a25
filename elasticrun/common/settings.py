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
    log_level: str = "INFO"
    worker_log_level: str = "WARNING"
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def elastic_wait_limit(self) -> float:
        """How long a worker may wait for its next round before giving up on the driver."""
        return self.elastic_timeout + self.start_timeout + 60.0
