"""One place that turns settings into the job's host source and launcher, for the ``elasticrun``
command and ``elasticrun.run()`` alike (the loop is handed both and builds neither)."""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping

from elasticrun.common.settings import JobSettings
from elasticrun.discovery.sources import CallableDiscovery, FixedHosts, ScriptDiscovery
from elasticrun.driver.driver import Source
from elasticrun.driver.launching import Launcher


def job_parts(settings: JobSettings, stack: contextlib.ExitStack,
              discovery: Callable[[], Mapping[str, int]] | None = None) -> tuple[Source, Launcher]:
    """The host source and the launcher ``settings`` ask for.

    ``--ray-address``: Ray's nodes are the hosts and Ray starts the workers (the session joins
    ``stack``: it leaves the cluster when the job ends). Otherwise workers start here or over
    SSH (``Launchers``), and the hosts come from ``discovery`` (``elasticrun.run``'s callable),
    the discovery script, or the fixed list (-H / --hostfile)."""
    if settings.ray_address:
        if discovery is not None:
            raise ValueError("discovery= cannot be combined with ray_address=: give one host source")
        from elasticrun.driver.launch.ray_launcher import RaySession  # Ray is optional

        ray = stack.enter_context(RaySession(settings))
        return ray.discovery, ray.launcher
    from elasticrun.driver.launch.launchers import Launchers

    source: Source
    if discovery is not None:
        source = CallableDiscovery(discovery, settings.discovery_timeout)
    elif settings.discovery_script:
        source = ScriptDiscovery(settings.discovery_script, settings.slots_per_host, settings.discovery_timeout)
    else:
        if settings.hosts is None:
            raise ValueError("no host source: give -H, --hostfile, --host-discovery-script or --ray-address")
        source = FixedHosts(settings.hosts)
    return source, Launchers(settings)
