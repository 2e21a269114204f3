"""Local scratch directories that do not outlive their process for long.

An upload is staged, a download landed, and a shard's part written in a
directory under the system's temporary directory: a checkpoint's size each.
A process killed with SIGKILL (the OOM killer, a scheduler, `torchrun`
restarting a worker on the same host) cannot remove its own, and a job that
is killed and restarted again and again would fill the disk with them.

So each directory `<tmp>/keras-ft-<kind>-<random>` has a sibling
`<same>.lock`, held with `flock()` by its process while the directory
exists. The kernel drops the lock when the process dies, however it dies:
the first scratch directory a later keras-ft process makes removes every
directory whose lock is free, and keeps every one whose lock is held (its
owner still runs). A forked child (a `PyDataset` worker, say) closes its
copies of the locks at once: it never uses its parent's scratch, and one
that outlives a killed parent must not keep it on disk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile

from keras_ft import events, holdings

try:
    import fcntl
except ImportError:  # Windows: no locks, so nothing is reaped.
    fcntl = None

PREFIX = "keras-ft-"
LOCK_SUFFIX = ".lock"

__all__ = ["make", "remove", "reap"]


def make(kind: str) -> str:
    """A new empty directory `<tmp>/keras-ft-<kind>-<random>`, held by this
    process until `remove()`; the first call in a process first removes the
    directories of dead processes (`reap()`)."""
    # Dead processes' directories are removed once per process, at its
    # first scratch directory.
    if events.first_time("scratch", "reap"):
        reap()
    while True:
        fd, lock = tempfile.mkstemp(prefix=f"{PREFIX}{kind}-", suffix=LOCK_SUFFIX)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # Another process's reap() took it in the instant between
                # its creation and our lock, and unlinks it: a new name.
                os.close(fd)
                continue
            try:
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # Reaped before we locked it.
                os.close(fd)
                continue
        path = lock[: -len(LOCK_SUFFIX)]
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # A dead lock's directory, not reaped yet.
            os.close(fd)
            continue
        # The process's, not a training's: held until the directory is
        # removed, and dropped with the process (how the next one knows).
        holdings.put("scratch", path, fd)
        return path


def remove(path: str) -> None:
    """Removes a directory from `make()` and its lock; ignores errors, as a
    clean-up after a failure must not raise over it."""
    shutil.rmtree(path, ignore_errors=True)
    fd = holdings.pop("scratch", path)
    with contextlib.suppress(OSError):
        os.remove(path + LOCK_SUFFIX)
    if fd is not None:
        os.close(fd)


def reap(directory: str | None = None) -> list[str]:
    """Removes the scratch directories in `directory` (the system's temporary
    directory by default) whose process has ended, and returns their paths.

    Only directories owned by this user, reached without a symlink, with a
    lock file no process holds, are removed.
    """
    if fcntl is None:
        return []
    directory = directory or tempfile.gettempdir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(LOCK_SUFFIX)):
            continue
        lock = os.path.join(directory, name)
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # Its process still runs.
            path = lock[: -len(LOCK_SUFFIX)]
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                info = None
            if info is not None:
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                    continue  # Not one of ours: left alone.
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            with contextlib.suppress(OSError):
                os.remove(lock)
        finally:
            os.close(fd)
    return removed


def _close_in_child() -> None:
    for fd in holdings.forget("scratch").values():  # The parent's to remove.
        with contextlib.suppress(OSError):
            os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
