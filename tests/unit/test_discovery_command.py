"""``--host-discovery-script``: a path, or (as with horovodrun) a command line for /bin/sh."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from elasticrun.discovery.sources import DiscoveryError, ScriptDiscovery, discovery_command


def executable(path: Path, text: str = "#!/bin/sh\necho localhost:2\n") -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_an_executable_file_runs_directly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = executable(tmp_path / "discover hosts.sh")  # a space in the path: still a file
    assert discovery_command(str(script)) == [str(script)]
    monkeypatch.chdir(tmp_path)
    assert discovery_command("discover hosts.sh") == [str(script)]  # made absolute


def test_a_command_line_runs_through_the_shell(tmp_path: Path) -> None:
    script = tmp_path / "discover.py"
    script.write_text("import sys\nprint(*sys.argv[1:], sep='\\n')\n")
    spec = f"{sys.executable} {script} a:1 'b:2' | sort -r"
    assert discovery_command(spec) == ["/bin/sh", "-c", spec]
    found = ScriptDiscovery(spec, 1, 10.0).discover()
    assert list(found.hosts.items()) == [("b", 2), ("a", 1)]


@pytest.mark.parametrize("spec,message", [
    ("/nonexistent/discover.sh", "/nonexistent/discover.sh: no such file"),
    ("/nonexistent/discover.sh --zone a", "/nonexistent/discover.sh: no such file"),
    ("no-such-command-here --zone a", "no-such-command-here: command not found"),
    ("no-such-command-here", "no-such-command-here: no such file"),
    ("python3 'unbalanced", "cannot split it into words"),
    ("   ", "empty command"),
])
def test_what_cannot_run_is_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        discovery_command(spec)


def test_a_file_that_is_not_executable(tmp_path: Path) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost\n")
    os.chmod(script, 0o644)
    with pytest.raises(ValueError, match=r"not executable \(try chmod \+x"):
        discovery_command(str(script))
    with pytest.raises(ValueError, match=r"not executable"):
        discovery_command(f"{script} --zone a")


@pytest.mark.parametrize("text,message", [
    ("#!/bin/sh\r\necho localhost:2\r\n",  # saved on Windows: the interpreter is '/bin/sh\r'
     r"could not be started: its #! interpreter '/bin/sh\\r' was not found \(CRLF line endings: run dos2unix on it\)$"),
    ("#!/no/such/interpreter -x\necho localhost:2\n",
     r"could not be started: its #! interpreter '/no/such/interpreter' was not found$"),
    ("echo localhost:2\n", r"could not be started: it has no #! line \(add one, e.g. #!/bin/sh\)$"),
    ("\ufeff#!/bin/sh\necho localhost:2\n",  # saved as UTF-8 with a BOM: the kernel sees no #!
     r"could not be started: it starts with a byte-order mark, before its #! line \(an editor's UTF-8 BOM"),
])
def test_a_script_the_kernel_cannot_run_says_why(tmp_path: Path, text: str, message: str) -> None:
    """Not the kernel's "No such file or directory" for a file that is there, or "Exec format error"."""
    script = executable(tmp_path / "discover.sh", text)
    with pytest.raises(DiscoveryError, match=message):
        ScriptDiscovery(str(script), 1, 10.0).discover()
