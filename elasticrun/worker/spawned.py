"""Run first in the processes a worker's multiprocessing starts with a new interpreter: its
``forkserver`` (which preloads this module) and each ``spawn`` child (whose ``-c`` program imports
it before ``spawn_main``). See ``forks._first_in_what_it_starts``. It installs
:mod:`elasticrun.worker.forks`' SIGTERM handling there at once, before the script is imported
again: a DataLoader worker importing torch (seconds) would otherwise die of a SIGTERM sent to every
process meanwhile. Anywhere else it does nothing (the process inherits no worker's mark, or is
the worker)."""

from elasticrun.worker import forks

forks.adopt(started=True)
