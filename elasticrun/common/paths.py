"""Checks that a job can write where it was told to, made before anything is launched.

A path the job cannot write (``--events /proc/x/y``, ``--output-filename /dev/null/out``)
used to surface as a traceback once the driver started; checked up front it is one line
naming the flag and the reason. The checks create missing parent directories exactly as
the job would (it would create them anyway) and leave no file behind.
"""

from __future__ import annotations

import errno
import os
import selectors
import stat
import tempfile
import time

#: How long reading a file the user named (--hostfile, --config-file) may take when it is a
#: pipe or a FIFO: `<(make_hosts)` is fine; a FIFO that no one finishes writing is not a hang.
READ_TIMEOUT_S = 10.0


def _reason(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    return text[:1].lower() + text[1:]


def _make_dirs(path: str, flag: str, given: str) -> None:
    """Create directory ``path`` and its missing parents; ValueError says why it cannot."""
    if os.path.isdir(path):
        return
    existing = path
    while not os.path.lexists(existing):  # the deepest part of the path that is there
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {given}: {existing} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        where = exc.filename if isinstance(exc.filename, str) else path
        raise ValueError(f"{flag} {given}: cannot create directory {where}: {_reason(exc)}") from None


def user_name(uid: int) -> str:
    """``uid``'s login name for a message (``uid N`` where it has none)."""
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def path_problem(path: str, gain: str, parent_gain: str = "", links: int = 0) -> str:
    """Why someone else could choose what ``path`` (absolute) leads to ("" if nobody can); for
    a path the job writes (a log, a timeline, its copies) or reads and obeys (a config file, a
    discovery script). ``gain`` says what they would gain (``"they choose which file the job
    writes"``), ``parent_gain`` what a directory anyone may write above it would let them do
    (``gain`` if not given).

    Checking only the last part is not enough: a neighbour who makes ``/tmp/tl`` and puts a link
    to one of your files in it as ``timeline.json`` has the job truncate that file, and a
    link ``/tmp/out -> /home/you/private`` has it write there. The rule is ``ssh``'s StrictModes,
    made to fit shared project directories and containers: every symbolic link on the way
    belongs to you or root; every directory on the way that anyone may write (``o+w``) belongs
    to you or root (``/tmp``; a Kubernetes emptyDir, 0777 without the sticky bit), and what is
    named right under such a directory belongs to you or root. A directory only its group may
    write (a team's project directory) is trusted as its group is. What does not exist yet is
    made by the job, as you."""
    me = os.geteuid()
    parts = [p for p in path.split("/") if p]
    current = "/"
    shared = False  # current is a directory anyone may write
    for i, name in enumerate(parts):
        here = os.path.join(current, name)
        try:
            st = os.lstat(here)
        except OSError:
            return ""  # missing: the rest is made by the job; otherwise opening says what is wrong
        if shared and st.st_uid not in (me, 0):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else \
                "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
            return f"{here} is {kind} that {user_name(st.st_uid)} made in {current}, which anyone may write: {gain}"
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (me, 0):
                return f"{here} is a symbolic link that {user_name(st.st_uid)} made: {gain}"
            try:
                target = os.readlink(here)
            except OSError:
                return ""
            rest = "/".join(parts[i + 1:])
            resolved = os.path.normpath(os.path.join(current, target, rest))
            if links >= 40:  # a loop (the kernel's ELOOP limit): opening says so
                return ""
            return path_problem(resolved, gain, parent_gain, links + 1)
        if not stat.S_ISDIR(st.st_mode) or i == len(parts) - 1:
            return ""  # the last part (its own rules are the caller's), or not a directory (opening says so)
        if st.st_mode & stat.S_IWOTH:
            if st.st_uid not in (me, 0):
                return f"{here} belongs to {user_name(st.st_uid)} and anyone may write it: {parent_gain or gain}"
            shared = True
        else:
            shared = False
        current = here
    return ""


def planted(path: str) -> str:
    """Why the job must not write to ``path``, a name the user gave ("" if it may): a symbolic
    link or a file that someone else put in a shared, sticky directory such as /tmp. A
    neighbour who guesses ``--timeline-filename /tmp/t.json`` could otherwise plant a link there
    to one of your files and have the job truncate it. The kernel refuses both where
    ``fs.protected_symlinks`` and ``fs.protected_regular`` are set (most distributions); many
    containers clear them, so the job checks for itself, with the kernel's rule: in a sticky,
    world-writable directory, only what you or the directory's owner made is followed or
    written, and no file with other hard links. Your own links anywhere (``--events
    /dev/stdout``) are yours to choose."""
    return _look(path)[0]


#: What a neighbour gains where :func:`path_problem` refuses a path the job writes.
WRITE_GAIN = "they choose which file the job writes"


def obeyed_file_problem(path: str) -> str:
    """Why a file the job reads and obeys (a config file, a hostfile, a discovery script) could
    be someone else's choice ("" if it could not): a path :func:`path_problem` refuses, or a
    file anyone may change. Such a file decides what runs as you, as ``ssh`` refuses a config
    file others may write."""
    full = os.path.abspath(path)
    why = path_problem(full, "they choose what the job reads and runs")
    if why:
        return why
    try:
        st = os.stat(full)
    except OSError:
        return ""  # (reading it says what is wrong)
    if stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IWOTH:
        return f"anyone may change it (mode {stat.S_IMODE(st.st_mode):04o}): chmod o-w {path}"
    return ""


def _look(path: str) -> tuple[str, bool]:
    """(:func:`planted`'s answer, whether ``path`` is a link that may be followed): the last
    part of the path by the kernel's rule, then the way to it (:func:`path_problem`)."""
    full = os.path.abspath(path)
    why, link = _look_last(full)
    if not why:
        why = path_problem(full, WRITE_GAIN)
    return (why, False) if why else ("", link)


def _look_last(full: str) -> tuple[str, bool]:
    try:
        d = os.stat(os.path.dirname(full))
        st = os.lstat(full)
    except OSError:
        return "", False  # (nothing there yet, or nothing to look at: the open says what is wrong)
    link = stat.S_ISLNK(st.st_mode)
    if not (d.st_mode & stat.S_ISVTX and d.st_mode & stat.S_IWOTH):
        return "", link
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:  # (a hard link to a file of yours, made by anyone)
        return "it is a file with other hard links, in a shared directory (not written)", False
    if st.st_uid in (os.geteuid(), d.st_uid):
        return "", link  # (the sticky bit keeps anyone else from replacing it before the open)
    if link:
        return f"it is a symbolic link that uid {st.st_uid} put in a shared directory (not followed)", True
    return f"it belongs to uid {st.st_uid}, in a shared directory (not written)", False


def open_user_file(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a file the user named, refusing what :func:`planted` names (OSError
    EPERM). A link planted after that look is not followed (``O_NOFOLLOW``)."""
    why, link = _look(path)
    if why:
        raise OSError(errno.EPERM, why)
    return os.open(path, flags | (0 if link else os.O_NOFOLLOW), mode)


def check_writable_file(path: str, flag: str) -> None:
    """Make sure the job can append to file ``path``: its directory exists (created if
    missing) and the file can be opened for writing. Raises ValueError with one line
    ("--events /x/y: cannot create directory /x: permission denied")."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ValueError(f"{flag} {path}: is a directory")
    _make_dirs(os.path.dirname(full), flag, path)
    why = planted(full)
    if why:
        raise ValueError(f"{flag} {path}: {why}; remove it or choose another path")
    # O_NONBLOCK: opening a FIFO with no reader fails at once instead of waiting for one.
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC
    created = False
    try:
        try:
            fd = os.open(full, flags | os.O_CREAT | os.O_EXCL, 0o666)
            created = True
        except FileExistsError:
            fd = os.open(full, flags)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write to it: {_reason(exc)}") from None
    os.close(fd)
    if created:  # the job creates it when it starts; a run refused later leaves nothing
        os.unlink(full)


def check_writable_dir(path: str, flag: str) -> None:
    """Make sure the job can create files in directory ``path`` (created if missing, with
    its parents). Raises ValueError with one line naming ``flag`` and the reason."""
    full = os.path.abspath(path)
    why = path_problem(full, "they choose where the job's output goes")
    if why:
        raise ValueError(f"{flag} {path}: {why}; use a directory of your own")
    _make_dirs(full, flag, path)
    try:
        with tempfile.TemporaryFile(dir=full):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write in it: {_reason(exc)}") from None


def read_bounded(path: str, limit: int, timeout: float | None = None) -> bytes:
    """At most ``limit + 1`` bytes of the file the user named (the caller refuses more),
    within ``timeout`` whatever it is: a regular file is read at once; a pipe or FIFO
    (``--hostfile <(make_hosts)``) until its end, which must come within ``timeout`` (the
    open never waits for a writer). OSError otherwise (``TimeoutError`` for the deadline),
    with a ``strerror`` to show."""
    timeout = READ_TIMEOUT_S if timeout is None else timeout  # (read at the call: a test may shorten it)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        data = bytearray()
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            while len(data) <= limit:
                chunk = os.read(fd, limit + 1 - len(data))
                if not chunk:
                    break
                data += chunk
            return bytes(data)
        deadline = time.monotonic() + timeout
        with selectors.PollSelector() as sel:  # (poll takes any descriptor; epoll refuses some)
            sel.register(fd, selectors.EVENT_READ)
            while len(data) <= limit:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"it did not end within {timeout:g} s (a pipe or FIFO that is never closed?)")
                if not sel.select(remaining):
                    continue
                try:
                    chunk = os.read(fd, limit + 1 - len(data))
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                data += chunk
        return bytes(data)
    finally:
        os.close(fd)
