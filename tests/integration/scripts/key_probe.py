"""Test worker: joins the job, starts a child that inherits its environment, and waits.

Usage: key_probe.py DIR. After ``hvd.init()`` it writes DIR/HOST-SLOT.json (atomically) with its
pid, the pid of a child it started (a subprocess inheriting the worker's environment, as a
DataLoader worker or a user's tool would), the driver's addresses, and the keys it read from its
pipe: the test needs them to know what to look for in /proc/PID/environ, and to play peers that
know some of them. Then it waits (heartbeats keep flowing) until DIR/stop exists and exits 0.
"""

import json
import os
import subprocess
import sys
import time

import elasticrun.torch as hvd
from elasticrun.worker import runtime
from elasticrun.worker.client import job_keys

out_dir = sys.argv[1]
hvd.init()
rt = runtime.get()
keys = job_keys()
# The child lives as long as this worker (and at most two minutes).
child = subprocess.Popen([sys.executable, "-c", "import os, time\nparent = os.getppid()\nend = time.monotonic() + 120\n"
                          "while os.getppid() == parent and time.monotonic() < end:\n    time.sleep(0.1)"])
info = {
    "pid": os.getpid(), "child": child.pid, "host": rt.hostname, "slot": rt.slot,
    "fd_var_left": "ELASTICRUN_SECRET_FD" in os.environ,
    "control": os.environ["ELASTICRUN_CONTROL_ADDR"],
    "job_id": os.environ["ELASTICRUN_JOB_ID"],
    "secret": keys.secret.hex(), "server_public": keys.server_public.decode(),
    "client_public": keys.client_public.decode(), "client_secret": keys.client_secret.decode(),
}
path = os.path.join(out_dir, f"{rt.hostname}-{rt.slot}.json")
with open(path + ".tmp", "w") as f:
    json.dump(info, f)
os.rename(path + ".tmp", path)
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out_dir, "stop")) and time.monotonic() < deadline:
    time.sleep(0.05)
child.kill()
child.wait()
