"""Atomic file writes: nothing a user saved is ever half-written or lost to a crash.

`atomic_path(final)` hands out a temporary path in the same directory; when the block ends
without an exception the file is fsynced, renamed over `final` with `os.replace` (atomic on
POSIX and Windows) and the directory is fsynced, so either the old or the new file exists,
whole. On an exception the temporary file is removed and `final` is untouched; only a kill
(SIGKILL, power loss) leaves one behind, which `is_temp_name` recognises for a later sweep.
`new_directory(final)` does the same for a directory of files (exports). Published files and
directories get the modes the user's umask gives new ones (`file_mode`), whatever the temp
file's or a writer's own mode was. This module does not decide formats; callers write
whatever they like to the temporary path.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

_TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")   # mkstemp(prefix=".<name>.", suffix=".tmp")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives a power loss (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make a finished temp directory `tmp` the directory `final` in one rename: every directory
    under `tmp` is fsynced first (its files are the caller's to fsync) and `final`'s parent
    after, so a crash leaves the old state or the whole new directory."""
    for path, _, _ in os.walk(tmp):
        fsync_dir(path)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def umask() -> int:
    """The process's umask, read without changing it where the OS shows it (Linux's
    /proc/self/status); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain `open(path, "w")` would give a new file: 0o666 less the umask."""
    return 0o666 & ~umask()


@contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `final`; publish it atomically if the block succeeds.
    The published file has the mode the user's umask gives new files (0644 under the usual
    022; mkstemp's 0600, or that of a writer's own temp file renamed onto the path, would hide
    results from the rest of a team)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())      # after the block: a writer may have replaced the file
        os.replace(tmp, final)
    finally:   # a folder turned read-only keeps it (the next start's sweep removes it); the
        with contextlib.suppress(OSError):   # error that got us here is the one to report
            tmp.unlink()
    fsync_dir(final.parent)


def is_temp_name(name: str) -> bool:
    """Whether `name` is one of atomic_path's temporary files (only a kill leaves one)."""
    return _TEMP_NAME.fullmatch(name) is not None


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> None:
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(final: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(final, text.encode())


def atomic_write_json(final: str | os.PathLike, payload: Any, indent: int | None = 1) -> None:
    atomic_write_text(final, json.dumps(payload, indent=indent) + "\n")


@contextmanager
def new_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory beside `final`; when the block succeeds, fsync its files and make
    it `final` in one rename (publish_dir). `final` must not exist or be an empty directory:
    ValueError otherwise, before anything is written (an export never overwrites)."""
    final = Path(final)
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise ValueError(f"output {str(final)!r} exists and is not an empty directory; choose "
                         "a new path (nothing is overwritten)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        for name in os.listdir(tmp):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp / name, file_mode())
        os.chmod(tmp, 0o777 & ~umask())      # mkdtemp's 0700 -> what mkdir gives
        if final.exists():
            final.rmdir()
        publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
