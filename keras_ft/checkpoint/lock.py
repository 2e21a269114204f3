"""One writer per backup directory.

An exclusive `flock()` on `<directory>/.lock`, taken at train begin and
released at train end. The kernel drops the lock when its process dies,
however it dies, so a killed trainer never blocks its own restart; the file's
contents (pid, host, start time) only serve the error message.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys

from keras_ft import holdings
from keras_ft.checkpoint.files import CHIEF_FILE, open_regular
from keras_ft.errors import DirectoryInUseError

try:
    import fcntl
except ImportError:  # Windows: `import keras_ft` works, a backup does not.
    fcntl = None

LOCK_FILE = ".lock"

__all__ = ["LOCK_FILE", "DirectoryInUseError", "DirectoryLock", "check_platform"]


def check_platform() -> None:
    """Raises where keras-ft cannot keep its promises.

    A backup needs POSIX file locks (`flock`) and atomic directory renames:
    Linux (tested) and other POSIX systems such as macOS.

    Raises:
        RuntimeError: on other platforms (Windows), saying what to use.
    """
    if fcntl is None:
        raise RuntimeError(
            f"keras-ft needs POSIX file locks (fcntl.flock), which {sys.platform} "
            "does not have: it runs on Linux and other POSIX systems (macOS). "
            "On Windows, train under WSL2 or in a Linux container, or use "
            "`keras.callbacks.BackupAndRestore`, which works here without "
            "keras-ft's crash-safety guarantees."
        )


class DirectoryLock:
    """An exclusive lock on `directory`, held until `release()` or death.

    Args:
        directory: The directory to lock; created if missing.
        name: The lock file's name in `directory`.
        label: What the lock guards, as the error names it (a worker's
            directory beside the backup, say); `directory` by default.
    """

    def __init__(self, directory: str, name: str = LOCK_FILE, label: str = ""):
        self.directory = directory
        self.path = os.path.join(directory, name)
        self.label = label or f"The backup directory {directory!r}"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises `DirectoryInUseError` naming its holder.

        Raises:
            ValueError: if the directory or its lock file is a symlink, or
                the lock file is not a regular file (a backup directory is
                untrusted input: keras-ft follows no link in it).
        """
        # A fit() that raised never reached train end: the next fit() in
        # this process (a notebook cell run again) takes its lock over.
        earlier = holdings.get("lock", os.path.realpath(self.path))
        if earlier is not None:
            earlier.release()
        os.makedirs(self.directory, exist_ok=True)
        if os.path.islink(self.directory):
            raise ValueError(
                f"{self.directory!r} is a symlink; keras-ft writes a backup only "
                "into a real directory. Replace the link by a directory."
            )
        # Held through a read-only descriptor: a file open for writing would
        # stop the filesystem from being remounted read-only under us.
        os.close(open_regular(self.path, os.O_WRONLY | os.O_CREAT, depth=CHIEF_FILE))
        fd = open_regular(self.path, os.O_RDONLY, depth=CHIEF_FILE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DirectoryInUseError(
                f"{self.label} is being written by "
                f"another training process ({holder}). Two trainings sharing a "
                "`backup_dir` would overwrite each other's backups: give this "
                "one its own `backup_dir`, or stop the other process first."
            ) from None
        started = datetime.datetime.now().isoformat(timespec="seconds")
        note = open_regular(self.path, os.O_WRONLY | os.O_TRUNC, depth=CHIEF_FILE)
        try:
            os.write(note, f"pid {os.getpid()} on {socket.gethostname()}, since "
                     f"{started}".encode())  # fmt: skip
        finally:
            os.close(note)
        self._fd = fd
        holdings.put("lock", os.path.realpath(self.path), self)

    def check(self) -> None:
        """Nothing to check: the kernel holds a `flock` until the process
        ends (a bucket's lease can lapse; see `RemoteLease.check()`)."""

    def release(self, remove: bool = False) -> None:
        """Releases the lock; with `remove=True` also deletes the lock file.

        With `remove=True` and the lock not held here, the file is deleted only
        if no one else holds it (a dead process's leftover).
        """
        if self._fd is None:
            if remove and os.path.exists(self.path):
                try:
                    self.acquire()
                except DirectoryInUseError:
                    return
                self.release(remove=True)
            return
        holdings.pop("lock", os.path.realpath(self.path), self)
        if remove:
            # Unlink while still holding it, so no one locks a doomed file.
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        os.close(self._fd)
        self._fd = None


def _close_in_child() -> None:
    # A forked child (a worker process loading a PyDataset, say) gets copies
    # of every descriptor, and a flock lasts while any copy is open: a child
    # that outlives the fit() (Keras' workers do when fit() raises) would
    # keep the directory locked against the next fit(), or the restart.
    for lock in holdings.forget("lock").values():
        if lock._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
            lock._fd = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
