"""elasticrun: an elastic, fault-tolerant launcher for PyTorch data-parallel training.

The driver (``elasticrun`` command) discovers hosts, assigns ranks and launches workers;
workers use :mod:`elasticrun.torch`, a ``horovod.torch``-compatible API.
"""

from elasticrun.common.version import VERSION as __version__

__all__ = ["run", "RunError", "__version__"]


def __getattr__(name: str):
    # Imported on first use: workers import this package too, and need none of the driver.
    if name in ("run", "RunError"):
        from elasticrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'elasticrun' has no attribute {name!r}")
