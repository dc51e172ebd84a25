"""The driver lifts its soft open-file limit to the hard one, and says when even that is short
of what the job's workers need (about 6 descriptors each)."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=50)


def test_the_soft_limit_is_lifted_to_the_hard_one_and_a_shortfall_is_said():
    r = _run("""
        import logging, resource
        from elasticrun.driver import driver
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        driver._raise_open_file_limit(100)  # needs ~856
        lifted = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        print("lifted", lifted == hard or lifted == resource.RLIM_INFINITY or lifted >= 856)
        driver._raise_open_file_limit(10_000_000)  # more than any hard limit here
    """)
    assert r.returncode == 0, r.stderr
    assert "lifted True" in r.stdout
    lines = [line for line in r.stderr.splitlines() if "open-file limit" in line]
    assert len(lines) == 1 and "10000000 workers need" in lines[0] and "ulimit -n" in lines[0], r.stderr


def test_nothing_is_said_when_the_limit_suffices():
    r = _run("""
        import logging
        from elasticrun.driver import driver
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        driver._raise_open_file_limit(2)
    """)
    assert r.returncode == 0 and "open-file limit" not in r.stderr, r.stderr


def test_a_small_job_lifts_it_too_and_so_does_every_worker():
    """A neighbour's idle connections take descriptors whatever the job's size: a worker whose
    gloo listener runs out of them is aborted by gloo (see common/limits.py)."""
    r = _run("""
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        from elasticrun.driver import driver
        driver._raise_open_file_limit(2)
        print("driver", resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (hard if hard != resource.RLIM_INFINITY else 1 << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        import elasticrun.torch as hvd
        hvd.init()  # standalone: a job of one
        print("worker", resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (hard if hard != resource.RLIM_INFINITY else 1 << 20))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["driver", "True", "worker", "True"], r.stdout
