"""Imported first by the forkserver a worker starts (``forks._preload_in_forkserver``): the
forkserver then handles SIGTERM as a process the worker forked does (``forks.adopt``). Python
imports it there only because a worker put it in the forkserver's preload list; anywhere else
it does nothing (the process inherits no worker's mark, or is the worker)."""

from elasticrun.worker import forks

forks.adopt(forkserver=True)
