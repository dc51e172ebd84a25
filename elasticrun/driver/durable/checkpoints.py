"""Durable copies of the job's newest commit, on the driver's disk (``--checkpoint-dir``).

Why on the driver's machine: on a spot cluster it is the one machine that stays, so a copy
there survives the loss of every worker host. Ranks send their shards of one commit over the
job's authenticated channel; this module writes them, so that:

* **a directory is trusted only when it is yours** (:meth:`CheckpointDir.open`). A copy's
  metadata is unpickled by the workers, so whoever can write the directory could run code as
  the job's user. As ``ssh`` treats ``~/.ssh``: the directory and every entry read from it must
  belong to the job's user and not be writable by group or others, nothing in it is reached
  through a symbolic link (every file is opened relative to the directory's descriptor with
  ``O_NOFOLLOW``; temporary files are created with ``O_EXCL``), and every copy is signed: its
  manifest carries an HMAC under the directory's own key (``key``, 0600, made with the
  directory), and the manifest holds the SHA-256 of every file. A copy whose signature does not
  check is never read further, whatever its checksums say;
* **one directory, one job.** The driver holds an exclusive lock (``lock``, ``flock``) for the
  job's life; a second job exits naming the holder. The lock dies with its process, so the
  same command after a driver's kill -9 takes it over and resumes;
* **a half-written copy is never taken for a whole one.** A copy is written into a hidden
  ``.tmp-*`` directory, every file and the directory are fsynced, and only then is it renamed
  to ``ckpt-NNNNNN``: a reader sees a whole copy or none;
* **a corrupt or truncated copy is found, not loaded** (:meth:`CheckpointDir.scan`), and never
  deleted: the driver moves an unusable copy aside (``unusable-ckpt-NNNNNN``) when it resumes
  from an older one, and refuses to start when none is usable;
* **rotation deletes only this job's copies.** Each copy names its *lineage*: a job that
  starts from nothing begins one, a job that resumes from a copy carries its lineage on. Copies
  beyond the newest ``keep`` are removed only within the writer's lineage, so a copy of another
  job (or of a run started with ``--fresh``) stays until its owner removes it.

Layout of ``ckpt-NNNNNN`` (NNNNNN grows across jobs in the same directory)::

    manifest.json   {"format": 2, "number", "commit", "steps", "saved_at", "job", "lineage", "world",
                     "meta": {"bytes", "sha256"}, "data": {"bytes", "shards": [[offset, bytes, sha256]]},
                     "mac": HMAC-SHA256(key, the rest, canonical JSON)}
    meta.bin        what rank 0 sent: the pickled non-tensor state and the index of the tensors
    data.bin        the tensors' bytes, back to back (their shards at their offsets)
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from elasticrun.common.paths import path_problem, user_name as _user

FORMAT = 2
_NAME = re.compile(r"^ckpt-(\d{6,})$")
_ANY_NUMBER = re.compile(r"ckpt-(\d{6,})")  # also in moved-aside names: numbers are never reused
KEY_FILE, LOCK_FILE, PROGRESS_FILE = "key", "lock", "progress.json"
#: A manifest, the key, the lock's note and the progress file are small: reads are bounded.
MAX_SMALL_FILE = 1 << 20
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class CheckpointError(Exception):
    """A durable copy could not be written or read; the message is one line for the user."""


class NoSpace(CheckpointError):
    """A copy could not be written for want of room (ENOSPC, EDQUOT)."""


def _write_error(text: str, exc: OSError) -> CheckpointError:
    """``text: why`` as the error a failed write is: NoSpace where the disk or quota is full."""
    kind = NoSpace if exc.errno in (errno.ENOSPC, errno.EDQUOT) else CheckpointError
    return kind(f"{text}: {_reason(exc)}")


class Unreadable(CheckpointError):
    """A copy that is not shown damaged but cannot be read now (permissions, an I/O error, a
    stale NFS handle, a format of a newer elasticrun): it must not be moved aside, nor an older
    copy resumed in its place."""


class UnsafePath(CheckpointError):
    """Someone else could choose what the directory's path leads to (:func:`_path_problem`)."""


class UntrustedDirectory(CheckpointError):
    """The directory (or an entry the job needs in it) is not the job user's alone."""


class DirectoryInUse(CheckpointError):
    """Another live job holds the directory's lock."""


@dataclass(frozen=True)
class Shard:
    offset: int
    size: int
    sha256: str


@dataclass
class Manifest:
    number: int
    commit: int  # the state's commit counter (TorchState/ObjectState), as the workers count
    steps: int  # optimizer steps at that commit (for "N steps back")
    saved_at: float  # wall time the commit was handed off
    job: str
    lineage: str  # the run of jobs this copy belongs to (see the module docstring)
    world: int  # ranks that sent shards
    meta_bytes: int
    meta_sha256: str
    data_bytes: int
    shards: list[Shard] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "number": self.number, "commit": self.commit, "steps": self.steps,
                "saved_at": self.saved_at, "job": self.job, "lineage": self.lineage, "world": self.world,
                "meta": {"bytes": self.meta_bytes, "sha256": self.meta_sha256},
                "data": {"bytes": self.data_bytes, "shards": [[s.offset, s.size, s.sha256] for s in self.shards]}}

    @classmethod
    def from_json(cls, obj: Any) -> "Manifest":
        try:
            if isinstance(obj["format"], int) and obj["format"] > FORMAT:
                raise Unreadable(f"it is of format {obj['format']!r}, written by a newer elasticrun version "
                                 f"(this one reads format {FORMAT})")
            if obj["format"] != FORMAT:
                raise CheckpointError(f"it is of format {obj['format']!r}, written by another elasticrun version "
                                      f"(this one reads format {FORMAT})")
            shards = [Shard(int(o), int(n), str(h)) for o, n, h in obj["data"]["shards"]]
            return cls(int(obj["number"]), int(obj["commit"]), int(obj["steps"]), float(obj["saved_at"]),
                       str(obj["job"]), str(obj["lineage"]), int(obj["world"]), int(obj["meta"]["bytes"]),
                       str(obj["meta"]["sha256"]), int(obj["data"]["bytes"]), shards)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"manifest.json is malformed ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class Durable:
    """A whole, verified copy on disk."""

    path: str
    manifest: Manifest

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@dataclass(frozen=True)
class Scan:
    """What :meth:`CheckpointDir.scan` found: the newest usable copy, and each newer copy that
    is not usable with why (newest first)."""

    newest: Durable | None
    unusable: list[tuple[str, str]]
    #: A copy that may be whole but cannot be read now (permissions, an I/O error, a newer
    #: format): (name, why). The scan stops there: an older copy must not be taken for it.
    blocked: tuple[str, str] | None = None


def _name(number: int) -> str:
    return f"ckpt-{number:06d}"


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _trusted(st: os.stat_result, what: str, private: bool = False) -> None:
    """Refuse ``what`` unless it belongs to this process's user and nobody else may write it
    (``private``: nor read it)."""
    if st.st_uid != os.geteuid():
        raise UntrustedDirectory(f"{what} belongs to {_user(st.st_uid)}, not to you ({_user(os.geteuid())})")
    mode = f"(mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & 0o022:
        raise UntrustedDirectory(f"{what} is writable to group or others {mode}")
    if private and st.st_mode & 0o077:
        raise UntrustedDirectory(f"{what} is open to group or others {mode}")


def _path_problem(path: str) -> str:
    """Why someone else could choose what the checkpoint directory ``path`` is (see
    :func:`elasticrun.common.paths.path_problem`: ``ssh``'s StrictModes, made to fit shared
    project directories and containers; a directory anyone may write above yours could move
    your copies away or swap in others)."""
    return path_problem(path, "they choose where the copies go", "they could move the copies away or swap in others")


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EROFS):  # a directory on a filesystem that cannot
            raise


def _exists(dir_fd: int, name: str) -> bool:
    """Entry ``name`` of the directory exists (a link counts; never followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _open_file(dir_fd: int, name: str, what: str) -> int:
    """A regular file of the directory, read-only, never through a link, checked as trusted."""
    try:
        # O_NONBLOCK: a FIFO planted in its place must not hang the open (it is refused below;
        # on a regular file the flag changes nothing).
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedDirectory(f"{what} is a symbolic link") from None
        if exc.errno == errno.ENOENT:
            raise CheckpointError(f"{what} is missing") from None
        raise Unreadable(f"cannot read {what}: {_reason(exc)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedDirectory(f"{what} is not a regular file")
        _trusted(st, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(dir_fd: int, name: str, what: str) -> int:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedDirectory(f"{what} is not a directory (a link or a file)") from None
        if exc.errno == errno.ENOENT:
            raise CheckpointError(f"cannot open {what}: {_reason(exc)}") from None
        raise Unreadable(f"cannot open {what}: {_reason(exc)}") from None
    try:
        _trusted(os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_small(fd: int, what: str) -> bytes:
    data = b""
    while len(data) <= MAX_SMALL_FILE:
        chunk = os.read(fd, MAX_SMALL_FILE + 1 - len(data))
        if not chunk:
            return data
        data += chunk
    raise CheckpointError(f"{what} is larger than {MAX_SMALL_FILE >> 10} KiB: it is not elasticrun's")


def _sha256_range(fd: int, offset: int, size: int, what: str) -> str:
    h = hashlib.sha256()
    left, at = size, offset
    while left > 0:
        chunk = os.pread(fd, min(left, 8 << 20), at)
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
        at += len(chunk)
    if left:
        raise CheckpointError(f"{what} is truncated ({size - left} of {size} bytes at offset {offset})")
    return h.hexdigest()


def _write_all(fd: int, data: bytes | memoryview, at: int | None = None) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if at is None else os.pwrite(fd, view, at)
        view = view[n:]
        if at is not None:
            at += n


def _remove_tree(dir_fd: int, name: str) -> None:
    """Remove entry ``name`` of the directory: a file or link is unlinked (never followed), a
    directory emptied (copies hold files only) and removed. Errors are left to the caller."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
    try:
        for entry in os.listdir(fd):
            try:
                os.unlink(entry, dir_fd=fd)
            except IsADirectoryError:
                _remove_tree(fd, entry)
            except OSError as exc:
                if exc.errno in (errno.EISDIR, errno.EPERM):  # Linux says EISDIR; some say EPERM
                    _remove_tree(fd, entry)
                else:
                    raise
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def check_directory(path: str, flag: str = "--checkpoint-dir") -> None:
    """Before the job starts: ``path`` is a directory of this user's that nobody else can
    write (created 0700 if missing, with its parents). ValueError: one line naming ``flag``,
    what is wrong and what to do."""
    try:
        CheckpointDir.open(path).close()
    except CheckpointError as exc:
        raise ValueError(refused(path, exc, flag)) from None


def refused(path: str, exc: CheckpointError, flag: str = "--checkpoint-dir") -> str:
    """The one line that says why :meth:`CheckpointDir.open` refused ``path``, and what to do."""
    if isinstance(exc, UnsafePath):
        return f"{flag} {path}: {exc}; use a directory of your own (for example under your home)"
    if isinstance(exc, UntrustedDirectory):
        if "belongs to" in str(exc):  # (chmod would not make it yours)
            return f"{flag} {path}: {exc}; use a directory of your own"
        return f"{flag} {path}: {exc}; run `chmod 700 {path}`, or use a directory of your own"
    return f"{flag} {path}: {exc}"


class CheckpointDir:
    """An open, trusted ``--checkpoint-dir``: every operation goes through its descriptor."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self.fd = fd
        self._key: bytes | None = None
        self._lock_fd = -1

    # --- opening, trust, key, lock --------------------------------------------------------------
    @classmethod
    def open(cls, path: str) -> "CheckpointDir":
        """Open ``path`` (created 0700 when missing), refusing it unless it is this user's and
        nobody else may write it (UntrustedDirectory, one line)."""
        path = os.path.abspath(path)
        problem = _path_problem(path)
        if problem:
            raise UnsafePath(problem)
        if not os.path.lexists(path):
            parent = os.path.dirname(path)
            existing = parent
            while not os.path.lexists(existing):  # the deepest part of the path that is there
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing):
                raise CheckpointError(f"{existing} is not a directory")
            try:
                os.makedirs(parent, exist_ok=True)
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass  # made meanwhile: checked below like any other
            except OSError as exc:
                where = exc.filename if isinstance(exc.filename, str) else path
                raise CheckpointError(f"cannot create directory {where}: {_reason(exc)}") from None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise CheckpointError("is not a directory") from None
        except OSError as exc:
            raise CheckpointError(f"cannot open it: {_reason(exc)}") from None
        try:
            st = os.fstat(fd)
            _trusted(st, "the directory")
            # Checked again now that it is open: the check above saw nothing at the path, and
            # someone else may have put a link there before it was made (mkdir's EEXIST above).
            # From here on everything goes through the descriptor, which the path led to.
            problem = _path_problem(path)
            if problem:
                raise UnsafePath(problem)
            try:
                now = os.stat(path)
            except OSError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise CheckpointError("it was replaced while it was opened; run the command again")
            if not os.access(path, os.W_OK | os.X_OK):
                try:
                    read_only = bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
                except OSError:
                    read_only = False
                raise CheckpointError("cannot write in it: " + ("it is on a read-only file system" if read_only
                                                                 else "permission denied"))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def moved(self) -> bool:
        """The path no longer leads to this directory (it was moved or deleted while open):
        copies still go into it, where a rerun given the path will not look."""
        if self.fd < 0:
            return False
        try:
            now, mine = os.stat(self.path), os.fstat(self.fd)
        except OSError:
            return True
        return (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino)

    def close(self) -> None:
        self.unlock()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def key(self) -> bytes:
        """The directory's signing key (``key``, 0600), made with its first use."""
        if self._key is not None:
            return self._key
        numbers = [] if _exists(self.fd, KEY_FILE) else self.numbers()
        if numbers:
            # A new key would make every copy here "not signed with this directory's key", and
            # none was written with it: the copies were signed with a key that is gone (deleted,
            # or a backup restored without it), or planted. None is ever loaded without it.
            shown = ", ".join(_name(n) for n in sorted(numbers)[:3]) + (", ..." if len(numbers) > 3 else "")
            raise UntrustedDirectory(f"{self.path}/{KEY_FILE} is missing, but the directory holds copies ({shown}): "
                                     f"none can be trusted without the key that signed it; put the key back, or "
                                     f"move the copies out of the directory")
        try:
            fd = os.open(KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=self.fd)
        except FileExistsError:
            fd = -1
        except OSError as exc:
            raise CheckpointError(f"cannot create {KEY_FILE}: {_reason(exc)}") from None
        if fd >= 0:  # a new key: written whole before anything is signed with it
            key = secrets.token_hex(32)
            try:
                _write_all(fd, key.encode())
                _fsync(fd)
            except OSError as exc:
                os.close(fd)
                os.unlink(KEY_FILE, dir_fd=self.fd)
                raise CheckpointError(f"cannot write {KEY_FILE}: {_reason(exc)}") from None
            os.close(fd)
            _fsync(self.fd)
        fd = _open_file(self.fd, KEY_FILE, f"{self.path}/{KEY_FILE}")
        try:
            _trusted(os.fstat(fd), f"{self.path}/{KEY_FILE}", private=True)
            text = _read_small(fd, KEY_FILE).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        if not re.fullmatch(r"[0-9a-f]{64}", text):
            raise UntrustedDirectory(f"{self.path}/{KEY_FILE} is not an elasticrun key")
        self._key = bytes.fromhex(text)
        return self._key

    def sign(self, manifest: Manifest) -> dict[str, Any]:
        body = manifest.as_json()
        body["mac"] = hmac.new(self.key(), canonical(body), hashlib.sha256).hexdigest()
        return body

    def lock(self, job: str) -> None:
        """Hold the directory for this job (until :meth:`unlock` or the process's end).
        DirectoryInUse names the live holder; a dead holder's lock is simply taken."""
        try:
            fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UntrustedDirectory(f"{self.path}/{LOCK_FILE} is a symbolic link") from None
            raise CheckpointError(f"cannot open {self.path}/{LOCK_FILE}: {_reason(exc)}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UntrustedDirectory(f"{self.path}/{LOCK_FILE} is not a regular file")
            _trusted(st, f"{self.path}/{LOCK_FILE}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DirectoryInUse(self._holder(fd)) from None
            note = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "job": job}
            try:
                os.ftruncate(fd, 0)
                _write_all(fd, json.dumps(note).encode(), 0)
            except OSError as exc:  # a full disk: the lock holds without its note
                raise CheckpointError(f"cannot write {self.path}/{LOCK_FILE}: {_reason(exc)}") from None
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def _holder(self, fd: int) -> str:
        try:
            note = json.loads(os.pread(fd, 4096, 0))
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(note["since"])))
            return (f"{self.path} is in use by job {str(note['job'])[:40]} (pid {int(note['pid'])} on host "
                    f"{str(note['host'])[:80]}, since {since})")
        except (OSError, ValueError, KeyError, TypeError):
            return f"{self.path} is in use by another elasticrun job"

    def unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = -1

    # --- reading copies -------------------------------------------------------------------------
    def numbers(self) -> list[int]:
        """Numbers of the copies (``ckpt-NNNNNN``), newest first."""
        return sorted((int(m.group(1)) for m in map(_NAME.match, os.listdir(self.fd)) if m), reverse=True)

    def next_number(self) -> int:
        """The number of the next copy: after every existing one, whole, broken or moved aside."""
        found = [int(m.group(1)) for m in map(_ANY_NUMBER.search, os.listdir(self.fd)) if m]
        return max(found, default=0) + 1

    def _manifest(self, copy_fd: int, name: str) -> Manifest:
        fd = _open_file(copy_fd, "manifest.json", f"{name}/manifest.json")
        try:
            raw = _read_small(fd, "manifest.json")
        finally:
            os.close(fd)
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise CheckpointError(f"manifest.json is not JSON ({exc})") from None
        mac = obj.pop("mac", None) if isinstance(obj, dict) else None
        if not isinstance(mac, str) or not hmac.compare_digest(
                mac, hmac.new(self.key(), canonical(obj), hashlib.sha256).hexdigest()):
            raise UntrustedDirectory("it is not signed with this directory's key (it was not written here by "
                                     "elasticrun, or it was changed since)")
        manifest = Manifest.from_json(obj)
        if _name(manifest.number) != name:
            raise CheckpointError(f"its manifest names copy {manifest.number}, not {name}")
        return manifest

    def verify(self, name: str) -> Manifest:
        """The manifest of copy ``name``, after checking its signature, then every file against it."""
        copy_fd = _open_dir(self.fd, name, name)
        try:
            manifest = self._manifest(copy_fd, name)
            fd = _open_file(copy_fd, "meta.bin", f"{name}/meta.bin")
            try:
                if _sha256_range(fd, 0, manifest.meta_bytes, "meta.bin") != manifest.meta_sha256:
                    raise CheckpointError("meta.bin does not match its checksum")
            finally:
                os.close(fd)
            fd = _open_file(copy_fd, "data.bin", f"{name}/data.bin")
            try:
                size = os.fstat(fd).st_size
                if size != manifest.data_bytes:
                    raise CheckpointError(f"data.bin has {size} bytes, its manifest says {manifest.data_bytes}")
                for s in manifest.shards:
                    if _sha256_range(fd, s.offset, s.size, "data.bin") != s.sha256:
                        raise CheckpointError(f"data.bin bytes {s.offset}..{s.offset + s.size} do not match "
                                              f"their checksum")
            finally:
                os.close(fd)
        except OSError as exc:
            raise Unreadable(f"cannot read it: {_reason(exc)}") from None
        finally:
            os.close(copy_fd)
        covered = sum(s.size for s in manifest.shards)
        if covered != manifest.data_bytes:
            raise CheckpointError(f"its shards cover {covered} of {manifest.data_bytes} bytes")
        return manifest

    def scan(self) -> Scan:
        """The newest usable copy, and why each newer one is not (they are left where they are)."""
        unusable: list[tuple[str, str]] = []
        for number in self.numbers():
            name = _name(number)
            try:
                return Scan(Durable(os.path.join(self.path, name), self.verify(name)), unusable)
            except Unreadable as exc:
                return Scan(None, unusable, (name, str(exc)))
            except CheckpointError as exc:
                unusable.append((name, str(exc)))
        return Scan(None, unusable)

    def move_aside(self, name: str) -> str:
        """Rename an unusable copy out of the way (never delete it): its new name."""
        for n in range(100):
            aside = f"unusable-{name}" + (f".{n}" if n else "")
            if not os.path.lexists(os.path.join(self.path, aside)):
                os.rename(name, aside, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                return aside
        raise CheckpointError(f"cannot move {name} aside: too many unusable copies of that number")

    def read_range(self, durable: Durable, file: str, offset: int, size: int) -> bytes:
        """Bytes of ``meta.bin`` or ``data.bin`` of a verified copy (a restoring worker's part)."""
        if file not in ("meta.bin", "data.bin"):
            raise CheckpointError(f"no file {file!r:.40} in a copy")
        copy_fd = _open_dir(self.fd, durable.name, durable.name)
        try:
            fd = _open_file(copy_fd, file, f"{durable.name}/{file}")
        finally:
            os.close(copy_fd)
        try:
            return os.pread(fd, size, offset)
        except OSError as exc:
            raise CheckpointError(f"cannot read {durable.name}/{file}: {_reason(exc)}") from None
        finally:
            os.close(fd)

    # --- housekeeping ---------------------------------------------------------------------------
    def clean_stale(self) -> None:
        """Remove temporary directories left by a driver of this directory that died writing
        (the lock says no other is writing now)."""
        for name in os.listdir(self.fd):
            if name.startswith(".tmp-ckpt-"):
                try:
                    _remove_tree(self.fd, name)
                except OSError:
                    pass

    def rotate(self, lineage: str, keep: int) -> list[str]:
        """Remove copies of ``lineage`` beyond its newest ``keep``; the names removed. Copies of
        other lineages, and any whose lineage cannot be read, are left alone."""
        ours = self._by_lineage(lineage, True)
        removed = []
        for name in ours[keep:]:
            try:
                _remove_tree(self.fd, name)
                removed.append(name)
            except OSError:
                pass
        return removed

    def others(self, lineage: str) -> list[str]:
        """Copies of other lineages (an earlier run's, kept by ``--fresh``), newest first: this
        job never removes them, so a full disk names them."""
        return self._by_lineage(lineage, False)

    def _by_lineage(self, lineage: str, same: bool) -> list[str]:
        """Names of the copies whose lineage is (``same``) or is not ``lineage``, newest first;
        a copy whose lineage cannot be read is in neither."""
        found: list[str] = []
        for number in self.numbers():
            name = _name(number)
            try:
                copy_fd = _open_dir(self.fd, name, name)
                try:
                    if (self._manifest(copy_fd, name).lineage == lineage) == same:
                        found.append(name)
                finally:
                    os.close(copy_fd)
            except CheckpointError:
                continue
        return found

    def save_progress(self, steps: int, commit: int, at: float | None = None) -> None:
        """How far the workers have got, and when (wall time; now if not given), for "N steps
        back" when a later run resumes: small, replaced atomically, never fsynced (a lost update
        only shortens that number). A temporary file is created exclusively, never through a
        link. OSError to the caller."""
        tmp = f".{PROGRESS_FILE}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=self.fd)
        except FileExistsError:  # left by a driver that died here, or planted: removed, not followed
            os.unlink(tmp, dir_fd=self.fd)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=self.fd)
        try:
            _write_all(fd, json.dumps({"steps": steps, "commit": commit,
                                       "at": time.time() if at is None else at}).encode())
        finally:
            os.close(fd)
        os.replace(tmp, PROGRESS_FILE, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def load_progress(self) -> tuple[int, int, float]:
        """(steps, commit, wall time) from :meth:`save_progress`, or (0, 0, 0.0)."""
        try:
            fd = _open_file(self.fd, PROGRESS_FILE, PROGRESS_FILE)
            try:
                obj = json.loads(_read_small(fd, PROGRESS_FILE))
            finally:
                os.close(fd)
            return int(obj["steps"]), int(obj["commit"]), float(obj.get("at", 0.0))
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            return 0, 0, 0.0


class Writer:
    """One durable copy being written: shards arrive (in any order), then :meth:`commit`.

    Not thread-safe on its own: the caller (one receiving thread) owns it.
    """

    def __init__(self, directory: CheckpointDir, number: int, *, commit: int, steps: int, saved_at: float,
                 job: str, lineage: str, world: int, data_bytes: int, meta: bytes | None = None):
        self.directory = directory
        self.name = _name(number)
        self.final = os.path.join(directory.path, self.name)
        self.tmp_name = f".tmp-{self.name}-{os.getpid()}"
        self.tmp = os.path.join(directory.path, self.tmp_name)
        self._manifest = Manifest(number, commit, steps, saved_at, job, lineage, world, 0, "", data_bytes)
        self._got: dict[int, Shard] = {}
        self._covered = 0
        # Each rank sends its shard in order: hash it as it comes (no read-back). Running
        # hashes by the offset their next chunk starts at: (hash, where the stream started).
        self._streams: dict[int, tuple[Any, int]] = {}
        self._tmp_fd = self._meta_fd = self._data = -1
        self._meta_done = False
        try:
            directory.key()  # a copy is signed when it is whole: the key must be there first
            try:
                os.mkdir(self.tmp_name, 0o700, dir_fd=directory.fd)
            except FileExistsError:  # ours, from an earlier attempt: removed, never followed
                _remove_tree(directory.fd, self.tmp_name)
                os.mkdir(self.tmp_name, 0o700, dir_fd=directory.fd)
            self._tmp_fd = os.open(self.tmp_name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=directory.fd)
            self._data = self._create("data.bin", data_bytes)
        except OSError as exc:
            self.abort()
            raise _write_error(f"cannot write in {directory.path}", exc) from None
        if meta is not None:
            self.meta_size(len(meta))
            self.write_meta(0, meta)
            self.meta_done(hashlib.sha256(meta).hexdigest())

    def _create(self, name: str, size: int) -> int:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=self._tmp_fd)
        os.ftruncate(fd, size)
        return fd

    def meta_size(self, size: int) -> None:
        """Rank 0 says how long the metadata is (it sends it in parts, like a shard)."""
        if self._meta_fd >= 0:
            return
        try:
            self._meta_fd = self._create("meta.bin", size)
        except OSError as exc:
            raise _write_error(f"cannot write {self.tmp}/meta.bin", exc) from None
        self._manifest.meta_bytes = size

    def write_meta(self, offset: int, chunk: bytes | memoryview) -> None:
        if self._meta_fd < 0:
            raise CheckpointError("metadata before its size")
        self._pwrite(self._meta_fd, "meta.bin", self._manifest.meta_bytes, offset, chunk)

    def meta_done(self, sha256: str) -> None:
        if self._meta_fd < 0:
            raise CheckpointError("metadata's end before its size")
        try:
            got = _sha256_range(self._meta_fd, 0, self._manifest.meta_bytes, "meta.bin")
        except OSError as exc:
            raise CheckpointError(f"cannot read back {self.tmp}/meta.bin: {_reason(exc)}") from None
        if got != sha256:
            raise CheckpointError("the metadata arrived damaged (checksum mismatch)")
        self._manifest.meta_sha256 = sha256
        self._meta_done = True

    def _pwrite(self, fd: int, name: str, size: int, offset: int, chunk: bytes | memoryview) -> None:
        if offset < 0 or offset + len(chunk) > size:
            raise CheckpointError(f"bytes {offset}..{offset + len(chunk)} lie outside {name}'s {size} bytes")
        try:
            _write_all(fd, chunk, offset)
        except OSError as exc:
            raise _write_error(f"cannot write {self.tmp}/{name}", exc) from None

    def write(self, offset: int, chunk: bytes | memoryview) -> None:
        """Bytes of data.bin at ``offset`` (a part of some rank's shard)."""
        self._pwrite(self._data, "data.bin", self._manifest.data_bytes, offset, chunk)
        h, start = self._streams.pop(offset, None) or (hashlib.sha256(), offset)
        if len(self._streams) < 4096:  # bounded: one stream per rank is the norm
            h.update(chunk)
            self._streams[offset + len(chunk)] = (h, start)

    def shard_done(self, offset: int, size: int, sha256: str) -> None:
        """A rank has sent all of its shard; check it against the rank's own checksum."""
        if offset in self._got:
            return
        if offset < 0 or size < 0 or offset + size > self._manifest.data_bytes:
            raise CheckpointError(f"a shard of bytes {offset}..{offset + size} lies outside the copy")
        stream = self._streams.pop(offset + size, None)
        if stream is not None and stream[1] == offset:
            got = stream[0].hexdigest()
        else:  # not sent in one ordered stream: hash what is on disk
            try:
                got = _sha256_range(self._data, offset, size, "data.bin")
            except OSError as exc:
                raise CheckpointError(f"cannot read back {self.tmp}/data.bin: {_reason(exc)}") from None
        if got != sha256:
            raise CheckpointError(f"the shard at {offset} arrived damaged (checksum mismatch)")
        self._got[offset] = Shard(offset, size, sha256)
        self._covered += size

    @property
    def complete(self) -> bool:
        return self._meta_done and self._covered == self._manifest.data_bytes and len(self._got) == self._manifest.world

    def commit(self, keep: int) -> Durable:
        """Make the copy durable and visible; drop this lineage's copies beyond the newest ``keep``."""
        self._manifest.shards = sorted(self._got.values(), key=lambda s: s.offset)
        d = self.directory
        try:
            for fd in (self._data, self._meta_fd):
                os.fsync(fd)
                os.close(fd)
            self._data = self._meta_fd = -1
            fd = os.open("manifest.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600,
                         dir_fd=self._tmp_fd)
            try:
                _write_all(fd, json.dumps(d.sign(self._manifest), indent=1).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync(self._tmp_fd)
            os.rename(self.tmp_name, self.name, src_dir_fd=d.fd, dst_dir_fd=d.fd)
            _fsync(d.fd)
        except OSError as exc:
            self.abort()
            raise _write_error(f"cannot finish {self.final}", exc) from None
        finally:
            if self._tmp_fd >= 0:
                os.close(self._tmp_fd)
                self._tmp_fd = -1
        try:
            d.rotate(self._manifest.lineage, keep)
        except OSError:
            pass  # an older copy left in place loses nothing
        return Durable(self.final, self._manifest)

    def abort(self) -> None:
        """Forget this copy (nothing already durable is touched)."""
        for name in ("_data", "_meta_fd", "_tmp_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, -1)
        try:
            _remove_tree(self.directory.fd, self.tmp_name)
        except OSError:
            pass
