"""Publishing files atomically, the one way every part of megacispo writes what others read: a file
or a directory is written beside its final name, flushed to disk, and renamed into place, so that a
reader (or a run after a crash) sees the old version or the whole new one, never half of it."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterator, TextIO


def flush_to_disk(file: BinaryIO | TextIO) -> None:
    """An open file's bytes on the disk, not only in the page cache."""
    file.flush()
    os.fsync(file.fileno())


def fsync_path(path: Path) -> None:
    """A written file's (or a directory's entries') bytes on the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file beside ``path``, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}.{secrets.token_hex(16)}.tmp"
    # os.open with 0o666 applies the umask, as open() would (mkstemp would leave the file 0600).
    file_descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(file_descriptor, "wb") as file:
            file.write(data)
            flush_to_disk(file)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def publish_directory(temporary: Path, final: Path, aside_prefix: str = ".tmp_") -> None:
    """Rename the finished directory ``temporary`` to ``final``: one atomic rename, two when ``final``
    exists (a directory cannot be renamed onto a non-empty one, so the old one is first moved aside,
    under ``aside_prefix``, and deleted once the new one is in place)."""
    if final.exists():
        replaced = final.with_name(f"{aside_prefix}replaced_{final.name}")
        os.rename(final, replaced)
        os.rename(temporary, final)
        shutil.rmtree(replaced)
    else:
        os.rename(temporary, final)
    fsync_path(final.parent)


@contextlib.contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A fresh directory beside ``out``, published as ``out`` when the block succeeds and removed when
    it fails: a failed write leaves nothing behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # Made by mkdir, whose mode the umask decides as for the user's other directories (mkdtemp's
    # would be 0700, and the rename would keep it).
    temporary = out.parent / f".tmp_{out.name}_{secrets.token_hex(8)}"
    temporary.mkdir()
    try:
        yield temporary
        publish_directory(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def atomic_save_pretrained(obj: Any, directory: str | os.PathLike) -> list[Path]:
    """``obj.save_pretrained`` (a transformers model or tokenizer) into a temporary directory inside
    ``directory``, then each file renamed into place: a reader never sees half a file. Returns the files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(dir=directory, prefix=".save_pretrained.") as staging:
        obj.save_pretrained(staging)
        for item in sorted(Path(staging).iterdir()):
            os.replace(item, directory / item.name)
            written.append(directory / item.name)
    return written


def check_writable_directory(field: str, path: str | os.PathLike) -> None:
    """ValueError naming ``field`` unless ``path`` is, or can be made, a directory this process writes
    in: checked at start-up, where a run would otherwise fail at its first write (a checkpoint after
    its first step, an export after the whole run)."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is below {existing}, a file"
        raise ValueError(f"{field} = {path} {what}, not a directory: choose a directory path")
    # access() answers for this user and for the filesystem (a read-only mount refuses even root).
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing}, where it would be made)"
        raise ValueError(f"{field} = {path}{where} is not writable by this user: choose a directory you can write "
                         f"in, or change its permissions")


LOCK_FILE = ".lock"


class DirectoryInUse(ValueError):
    """Another live process holds the directory's lock; the message names it (host, PID, start)."""


@dataclasses.dataclass
class DirectoryLock:
    """A directory's lock file (``LOCK_FILE``), held by this process through ``file``: an exclusive
    flock, which the kernel releases when the process ends however it ends, so a lock whose holder is
    gone is taken over. The file names its holder for whoever finds it held."""

    path: Path
    file: TextIO
    previous_holder: str
    """The holder recorded by a process that ended without releasing the lock ('' if none)."""
    made_directory: bool
    """The lock made the directory: its release removes it again if nothing else was written there."""

    def release(self) -> None:
        """Remove the lock file (still held, so no other process takes it meanwhile) and let go."""
        self.path.unlink()
        self.file.close()
        if self.made_directory and not any(self.path.parent.iterdir()):
            self.path.parent.rmdir()


def lock_directory(directory: str | os.PathLike, field: str) -> DirectoryLock:
    """Take ``directory``'s lock for this process (making the directory); DirectoryInUse naming
    ``field``, the holder and the fix while another live process holds it."""
    directory = Path(directory)
    made_directory = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    file = open(path, "a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "a process that has not named itself yet"
        file.close()
        raise DirectoryInUse(f"{field} = {directory} is in use by {holder} (lock {path}): wait for that run to end, "
                             f"or choose another {field}") from None
    file.seek(0)
    previous = file.read().strip()
    file.seek(0)
    file.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    file.write(f"the run of PID {os.getpid()} on host {socket.gethostname()}, started {started}\n")
    flush_to_disk(file)
    return DirectoryLock(path, file, previous, made_directory)
