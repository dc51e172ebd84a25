"""Durable copies of the job's newest commit, on the driver's disk (``--checkpoint-dir``).

Why on the driver's machine: on a spot cluster it is the one machine that stays, so a copy
there survives the loss of every worker host. Ranks send their shards of one commit over the
job's authenticated channel; this module writes them, so that:

* **a half-written copy is never taken for a whole one.** A copy is written into a hidden
  ``.tmp-*`` directory, every file and the directory are fsynced, and only then is it renamed
  to ``ckpt-NNNNNN``: a reader sees a whole copy or none;
* **a corrupt or truncated copy is found, not loaded.** ``manifest.json`` holds the SHA-256 of
  every shard and of the metadata; :func:`newest` checks them and falls back to the older copy
  with one line saying why;
* **nothing durable is lost to a broken write.** A failed write (full disk, unwritable
  directory) removes its temporary directory and leaves the existing copies alone; only after
  a new copy is complete are copies beyond the newest ``keep`` removed.

Layout of ``ckpt-NNNNNN`` (NNNNNN grows across jobs in the same directory)::

    manifest.json   {"format": 1, "number", "commit", "steps", "saved_at", "job", "world",
                     "meta": {"bytes", "sha256"}, "data": {"bytes", "shards": [[offset, bytes, sha256]]}}
    meta.bin        what rank 0 sent: the pickled non-tensor state and the index of the tensors
    data.bin        the tensors' bytes, back to back (their shards at their offsets)

The files are created readable by their owner only: they hold the job's model and, like any
pickle, must come from a trusted place (the metadata is unpickled by the job's workers).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{6,})$")


class CheckpointError(Exception):
    """A durable copy could not be written or read; the message is one line for the user."""


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
    world: int  # ranks that sent shards
    meta_bytes: int
    meta_sha256: str
    data_bytes: int
    shards: list[Shard] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "number": self.number, "commit": self.commit, "steps": self.steps,
                "saved_at": self.saved_at, "job": self.job, "world": self.world,
                "meta": {"bytes": self.meta_bytes, "sha256": self.meta_sha256},
                "data": {"bytes": self.data_bytes, "shards": [[s.offset, s.size, s.sha256] for s in self.shards]}}

    @classmethod
    def from_json(cls, obj: Any) -> "Manifest":
        try:
            if obj["format"] != FORMAT:
                raise CheckpointError(f"format {obj['format']!r}, this elasticrun reads format {FORMAT}")
            shards = [Shard(int(o), int(n), str(h)) for o, n, h in obj["data"]["shards"]]
            return cls(int(obj["number"]), int(obj["commit"]), int(obj["steps"]), float(obj["saved_at"]),
                       str(obj["job"]), int(obj["world"]), int(obj["meta"]["bytes"]), str(obj["meta"]["sha256"]),
                       int(obj["data"]["bytes"]), shards)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"manifest.json is malformed ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class Durable:
    """A whole, verified copy on disk."""

    path: str
    manifest: Manifest


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numbers(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)) for m in map(_NAME.match, names) if m), reverse=True)


def _name(number: int) -> str:
    return f"ckpt-{number:06d}"


def _sha256_range(f: Any, offset: int, size: int) -> str:
    h = hashlib.sha256()
    f.seek(offset)
    left = size
    while left > 0:
        chunk = f.read(min(left, 8 << 20))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    if left:
        raise CheckpointError(f"data.bin is truncated ({size - left} of {size} bytes at offset {offset})")
    return h.hexdigest()


def verify(path: str) -> Manifest:
    """The manifest of the copy at ``path``, after checking every file against it."""
    try:
        with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
            manifest = Manifest.from_json(json.load(f))
    except OSError as exc:
        raise CheckpointError(f"cannot read its manifest.json: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"manifest.json is not JSON ({exc})") from None
    try:
        with open(os.path.join(path, "meta.bin"), "rb") as f:
            if _sha256_range(f, 0, manifest.meta_bytes) != manifest.meta_sha256:
                raise CheckpointError("meta.bin does not match its checksum")
        data = os.path.join(path, "data.bin")
        if os.path.getsize(data) != manifest.data_bytes:
            raise CheckpointError(f"data.bin has {os.path.getsize(data)} bytes, its manifest says "
                                  f"{manifest.data_bytes}")
        with open(data, "rb") as f:
            for s in manifest.shards:
                if _sha256_range(f, s.offset, s.size) != s.sha256:
                    raise CheckpointError(f"data.bin bytes {s.offset}..{s.offset + s.size} do not match their checksum")
    except OSError as exc:
        raise CheckpointError(f"cannot read it: {exc.strerror or exc}") from None
    covered = sum(s.size for s in manifest.shards)
    if covered != manifest.data_bytes:
        raise CheckpointError(f"its shards cover {covered} of {manifest.data_bytes} bytes")
    return manifest


def newest(directory: str, warn: Any = None) -> Durable | None:
    """The newest whole, verified copy in ``directory`` (None: there is none). Broken copies
    are skipped, each with one line through ``warn``; they are left on disk for inspection."""
    for number in _numbers(directory):
        path = os.path.join(directory, _name(number))
        try:
            return Durable(path, verify(path))
        except CheckpointError as exc:
            if warn is not None:
                warn(f"checkpoint {path} is unusable ({exc}); trying an older one")
    return None


class Writer:
    """One durable copy being written: shards arrive (in any order), then :meth:`commit`.

    Not thread-safe on its own: the caller (one receiving thread) owns it.
    """

    def __init__(self, directory: str, number: int, *, commit: int, steps: int, saved_at: float, job: str,
                 world: int, data_bytes: int, meta: bytes | None = None):
        self.directory = directory
        self.final = os.path.join(directory, _name(number))
        self.tmp = os.path.join(directory, f".tmp-{_name(number)}-{os.getpid()}")
        self._manifest = Manifest(number, commit, steps, saved_at, job, world, 0, "", data_bytes)
        self._got: dict[int, Shard] = {}
        self._covered = 0
        # Each rank sends its shard in order: hash it as it comes (no read-back). Running
        # hashes by the offset their next chunk starts at: (hash, where the stream started).
        self._streams: dict[int, tuple[Any, int]] = {}
        self._meta_fd = self._data = -1
        self._meta_done = False
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)
            os.mkdir(self.tmp, 0o700)
            self._data = self._create("data.bin", data_bytes)
        except OSError as exc:
            self.abort()
            raise CheckpointError(f"cannot write in {directory}: {exc.strerror or exc}") from None
        if meta is not None:
            self.meta_size(len(meta))
            self.write_meta(0, meta)
            self.meta_done(hashlib.sha256(meta).hexdigest())

    def _create(self, name: str, size: int) -> int:
        fd = os.open(os.path.join(self.tmp, name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, size)
        return fd

    def meta_size(self, size: int) -> None:
        """Rank 0 says how long the metadata is (it sends it in parts, like a shard)."""
        if self._meta_fd >= 0:
            return
        try:
            self._meta_fd = self._create("meta.bin", size)
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.tmp}/meta.bin: {exc.strerror or exc}") from None
        self._manifest.meta_bytes = size

    def write_meta(self, offset: int, chunk: bytes | memoryview) -> None:
        if self._meta_fd < 0:
            raise CheckpointError("metadata before its size")
        self._pwrite(self._meta_fd, "meta.bin", self._manifest.meta_bytes, offset, chunk)

    def meta_done(self, sha256: str) -> None:
        try:
            with open(os.path.join(self.tmp, "meta.bin"), "rb") as f:
                got = _sha256_range(f, 0, self._manifest.meta_bytes)
        except OSError as exc:
            raise CheckpointError(f"cannot read back {self.tmp}/meta.bin: {exc.strerror or exc}") from None
        if got != sha256:
            raise CheckpointError("the metadata arrived damaged (checksum mismatch)")
        self._manifest.meta_sha256 = sha256
        self._meta_done = True

    def _write_file(self, name: str, blob: bytes) -> None:
        fd = os.open(os.path.join(self.tmp, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def _pwrite(self, fd: int, name: str, size: int, offset: int, chunk: bytes | memoryview) -> None:
        if offset < 0 or offset + len(chunk) > size:
            raise CheckpointError(f"bytes {offset}..{offset + len(chunk)} lie outside {name}'s {size} bytes")
        try:
            view = memoryview(chunk)
            at = offset
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.tmp}/{name}: {exc.strerror or exc}") from None

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
        stream = self._streams.pop(offset + size, None)
        if stream is not None and stream[1] == offset:
            got = stream[0].hexdigest()
        else:  # not sent in one ordered stream: hash what is on disk
            try:
                with open(os.path.join(self.tmp, "data.bin"), "rb") as f:
                    got = _sha256_range(f, offset, size)
            except OSError as exc:
                raise CheckpointError(f"cannot read back {self.tmp}/data.bin: {exc.strerror or exc}") from None
        if got != sha256:
            raise CheckpointError(f"the shard at {offset} arrived damaged (checksum mismatch)")
        self._got[offset] = Shard(offset, size, sha256)
        self._covered += size

    @property
    def complete(self) -> bool:
        return self._meta_done and self._covered == self._manifest.data_bytes and len(self._got) == self._manifest.world

    def commit(self, keep: int) -> Durable:
        """Make the copy durable and visible; drop copies beyond the newest ``keep``."""
        self._manifest.shards = sorted(self._got.values(), key=lambda s: s.offset)
        try:
            for fd in (self._data, self._meta_fd):
                os.fsync(fd)
                os.close(fd)
            self._data = self._meta_fd = -1
            self._write_file("manifest.json", json.dumps(self._manifest.as_json(), indent=1).encode())
            _fsync_dir(self.tmp)
            os.rename(self.tmp, self.final)
            _fsync_dir(self.directory)
        except OSError as exc:
            self.abort()
            raise CheckpointError(f"cannot finish {self.final}: {exc.strerror or exc}") from None
        for number in _numbers(self.directory)[keep:]:
            shutil.rmtree(os.path.join(self.directory, _name(number)), ignore_errors=True)
        return Durable(self.final, self._manifest)

    def abort(self) -> None:
        """Forget this copy (nothing already durable is touched)."""
        for name in ("_data", "_meta_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, -1)
        shutil.rmtree(self.tmp, ignore_errors=True)


def next_number(directory: str) -> int:
    """The number of the next copy in ``directory`` (after every existing one, whole or not)."""
    return (max(_numbers(directory), default=0)) + 1


def read_range(path: str, name: str, offset: int, size: int) -> bytes:
    """Bytes of a file of a verified copy (what a restoring worker fetches, part by part)."""
    with open(os.path.join(path, name), "rb") as f:
        f.seek(offset)
        return f.read(size)


def clean_stale(directory: str) -> None:
    """Remove temporary directories left by a driver that died while writing."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(".tmp-ckpt-"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def age(durable: Durable, now: float | None = None) -> float:
    """Seconds since the copy's commit was handed off."""
    return (time.time() if now is None else now) - durable.manifest.saved_at


def save_progress(directory: str, steps: int, commit: int) -> None:
    """How far the workers have got (for "N steps back" when a later run resumes): small,
    replaced atomically, never fsynced (a lost update only shortens that number)."""
    tmp = os.path.join(directory, ".progress.json.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"steps": steps, "commit": commit, "at": time.time()}, f)
        os.replace(tmp, os.path.join(directory, "progress.json"))
    except OSError:
        pass


def load_progress(directory: str) -> tuple[int, int]:
    """(steps, commit) from :func:`save_progress`, or (0, 0)."""
    try:
        with open(os.path.join(directory, "progress.json"), encoding="utf-8") as f:
            obj = json.load(f)
        return int(obj["steps"]), int(obj["commit"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0
