"""elasticrun: an elastic, fault-tolerant launcher for PyTorch data-parallel training.

The driver (``elasticrun`` command) discovers hosts, assigns ranks and launches workers;
workers use :mod:`elasticrun.torch`, a ``horovod.torch``-compatible API.
"""

__version__ = "0.1.0"
