"""Publishing files atomically, the one way every part of megacispo writes what others read: a file
or a directory is written beside its final name, flushed to disk, and renamed into place, so that a
reader (or a run after a crash) sees the old version or the whole new one, never half of it."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
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
