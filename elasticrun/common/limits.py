"""The open-file limit, lifted where a process can lift it itself.

Many systems give a process a soft limit of 1,024 descriptors under a hard limit many times
that. A driver of a few hundred workers exhausts 1,024 (connections then fail where nothing
says why), and so does a worker whose DataLoader shares tensors through descriptors. Worse,
anyone on the machine can take them: a neighbour who holds a thousand idle connections to a
worker's gloo port makes gloo's listener fail to accept, and gloo aborts the process. The
hard limit is as far as an unprivileged process may go; lifting the soft one to it costs
nothing until descriptors are used.
"""

from __future__ import annotations

__all__ = ["lift_open_files"]

#: Used where the hard limit is unlimited: the kernel's own ceiling is usually 1,048,576.
UNLIMITED_SOFT = 1 << 20


def lift_open_files() -> int | None:
    """Set the soft open-file limit to the hard one; the soft limit now (None: not POSIX)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_SOFT if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # a kernel ceiling (fs.nr_open) below it: keep what we have
            pass
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft
