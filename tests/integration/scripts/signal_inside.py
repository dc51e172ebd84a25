"""The elasticrun CLI with one SIGTERM sent to itself from inside a chosen function of the
driver, once a file exists: a signal that lands there, deterministically (a real one, from
outside, lands there now and then: in a request's handler, in a log line's write).

    SIGNAL_IN=elasticrun.driver.driver:ElasticDriver._on_heartbeat SIGNAL_WHEN=/path/to/file \
        python signal_inside.py ELASTICRUN-ARGS...
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time

where, _, attr_path = os.environ["SIGNAL_IN"].partition(":")
owner_name, _, attr = attr_path.rpartition(".")
owner = importlib.import_module(where)
for part in owner_name.split("."):
    owner = getattr(owner, part)
original = getattr(owner, attr)
fired = False


def wrapped(*args, **kwargs):
    global fired
    # Only in the driver's main thread, where Python runs signal handlers (a console line is also
    # written by the threads that relay the workers' output).
    if (not fired and threading.current_thread() is threading.main_thread()
            and os.path.exists(os.environ["SIGNAL_WHEN"])):
        fired = True
        os.kill(os.getpid(), signal.SIGTERM)
        # Python runs its handler in the main thread at its next check, within this wait.
        for _ in range(50):
            time.sleep(0.002)
    return original(*args, **kwargs)


setattr(owner, attr, wrapped)

from elasticrun.__main__ import main  # noqa: E402

sys.exit(main())
