"""Names of the environment variables through which the driver configures a worker.

None of them is secret: the job's keys travel through an inherited pipe whose descriptor
number is in ``ELASTICRUN_SECRET_FD`` (see ``elasticrun.common.secretpipe``), so neither ``ps``
nor ``/proc/PID/environ`` nor a child of the worker ever sees them.
"""

from __future__ import annotations

# The assignment at launch (horovod's HOROVOD_* equivalents).
HOSTNAME = "ELASTICRUN_HOSTNAME"
RANK = "ELASTICRUN_RANK"
SIZE = "ELASTICRUN_SIZE"
LOCAL_RANK = "ELASTICRUN_LOCAL_RANK"
LOCAL_SIZE = "ELASTICRUN_LOCAL_SIZE"
CROSS_RANK = "ELASTICRUN_CROSS_RANK"
CROSS_SIZE = "ELASTICRUN_CROSS_SIZE"

# How to reach the driver, and who this worker is.
JOB_ID = "ELASTICRUN_JOB_ID"
SECRET_FD = "ELASTICRUN_SECRET_FD"  # read end of the pipe holding the keys; read once, then closed
DEATH_FD = "ELASTICRUN_DEATH_FD"  # a memfd the worker's main thread arms (common/deathnotice.py)
# "PID:FD", set by a worker for what it starts: where its SIGTERM's time is (worker/forks.py). A
# process that inherits it and is not that worker is none (hvd.init() there joins nothing).
WORKER_MARK = "ELASTICRUN_WORKER_MARK"
CONTROL_ADDR = "ELASTICRUN_CONTROL_ADDR"  # driver ROUTER: rendezvous, store, heartbeats, notifications
WORKER_ID = "ELASTICRUN_WORKER_ID"
DURABLE_ADDR = "ELASTICRUN_DURABLE_ADDR"  # driver ROUTER for durable copies (only with --checkpoint-dir)
SLOT = "ELASTICRUN_SLOT"
# "1": the worker joins a job whose rounds have begun. Its hvd.init() connects but takes no place
# yet: it asks for one at its first collective or elastic.run's first sync, so the survivors
# train on while it builds its model and loads its data (see worker/runtime.py, init).
JOINING = "ELASTICRUN_JOINING"
# "0" (--no-prefetch): a joining worker does not fetch the committed model from rank 0 before it
# asks for its place (worker/prefetch.py); the join's sync then sends all of it.
PREFETCH = "ELASTICRUN_FETCH_BEFORE_JOINING"  # (the option variable is ELASTICRUN_PREFETCH)

# Timeouts (seconds) the worker must respect.
COLLECTIVE_TIMEOUT = "ELASTICRUN_COLLECTIVE_TIMEOUT"
RENDEZVOUS_TIMEOUT = "ELASTICRUN_RENDEZVOUS_TIMEOUT"
HEARTBEAT_INTERVAL = "ELASTICRUN_HEARTBEAT_INTERVAL"
DRIVER_TIMEOUT = "ELASTICRUN_DRIVER_TIMEOUT"
DRIVER_PROCESS = "ELASTICRUN_DRIVER_PROCESS"  # the driver's process, for workers on its machine (common/liveness.py)
LOG_LEVEL = "ELASTICRUN_LOG_LEVEL"
SIGTERM_GRACE = "ELASTICRUN_SIGTERM_GRACE"  # a worker told to stop leaves gracefully within this
EXIT_GRACE = "ELASTICRUN_EXIT_GRACE"  # a dismissed worker still running this long after is ended (30 s)
BACKEND = "ELASTICRUN_BACKEND"  # --backend: auto, gloo or nccl (what carries CUDA tensors)

