"""Exclusive ownership of a directory by one live process: an advisory lock the kernel releases.

`claim_directory(directory, what)` opens `<directory>/.moescale.lock` (O_NOFOLLOW: a planted
symlink is refused, never followed or truncated; the file must be a regular file) and takes
`fcntl.flock(LOCK_EX | LOCK_NB)` on it, then writes the owner ("pid <pid> on <host>") into it.
A second claim, by another process or another open of the same process, fails at once with
`DirectoryInUse` (a ValueError: `moescale` prints it as one line, exit 2) naming the owner read
from the file. The lock belongs to the open file description: `release()` (or the object's
collection, or the process's death, SIGKILL included) frees it, so a crash never leaves a stale
lock. `release()` removes the file while still holding it; a claimant that had opened it before
finds, once it wins the lock, that the path names another file (or none) and claims again, so
two owners never coexist. After a kill the file stays and names the dead owner; the next claim
takes it over.

`hold_file(path)` is the same open, blocking: the caller waits for the holder (the token cache's
build lock, corpus.py). Not here: what the claimed directory holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat

LOCK_NAME = ".moescale.lock"


class DirectoryInUse(ValueError):
    """The directory belongs to another live process (its owner named in the message)."""


def _open_regular(path: str) -> int:
    """An O_NOFOLLOW read-write descriptor of the regular file `path` (created if missing)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"{path!r} is a symbolic link; moescale never follows a link where "
                             "it creates files: remove it") from None
        raise ValueError(f"cannot open the lock file {path!r} ({err.strerror}); check the "
                         "directory's permissions") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:    # a hard link would be written to
        os.close(fd)
        raise ValueError(f"{path!r} is not a regular file of its own (a device, a folder or a "
                         "hard link); remove it")
    return fd


class DirLock:
    """A held lock file (see the module docstring); `release()` is idempotent."""

    def __init__(self, fd: int, path: str, remove: bool = False) -> None:
        self.fd, self.path, self.remove = fd, path, remove
        self.created = False     # the claimant made the directory (its caller sets this)

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Drop the lock; a claimed directory's lock file is removed first, while still held
        (a claimant that opened it meanwhile sees that it is gone and opens the new one)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if self.remove and _is_current(fd, self.path):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(fd)          # closing the last descriptor drops the flock

    def __del__(self) -> None:
        try:               # at interpreter exit the os module may already be gone
            self.release()
        except Exception:  # noqa: BLE001 - the process ends: the kernel drops the lock
            pass

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def owner_text() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _owner_of(path: str) -> str:
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
            text = f.read(200).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text if text.startswith("pid ") else "another process"


def _is_current(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd` (not removed or replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _locked(path: str, flags: int) -> int:
    """A descriptor of `path` holding flock(flags), of the file the path names now: a lock
    won on a file its owner removed meanwhile (release) is let go and the claim tried again."""
    while True:
        fd = _open_regular(path)
        try:
            fcntl.flock(fd, flags)
        except BaseException:
            os.close(fd)
            raise
        if _is_current(fd, path):
            return fd
        os.close(fd)


def claim_file(path: str | os.PathLike, what: str, fix: str) -> DirLock:
    """Hold the lock file `path` exclusively (no waiting) or raise DirectoryInUse:
    "<what> is in use by a live run (<owner>); <fix>". The file is removed on release."""
    path = os.fspath(path)
    try:
        fd = _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        owner = _owner_of(path)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DirectoryInUse(f"{what} is in use by a live run ({owner}); {fix}") from None
        raise ValueError(f"cannot lock {path!r} ({err.strerror}); {fix}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (owner_text() + "\n").encode(), 0)
    return DirLock(fd, path, remove=True)


def claim_directory(directory: str | os.PathLike, what: str, fix: str) -> DirLock:
    """claim_file on `<directory>/.moescale.lock` (the directory must exist)."""
    return claim_file(os.path.join(os.fspath(directory), LOCK_NAME), what, fix)


def hold_file(path: str | os.PathLike) -> DirLock:
    """Hold the lock file `path` exclusively, waiting for a holder to finish."""
    path = os.fspath(path)
    return DirLock(_locked(path, fcntl.LOCK_EX), path)
