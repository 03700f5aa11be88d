"""The run directory's owner lock: one ``shardax train`` job writes into an ``--out`` at a time.

`RunLock` creates ``<out>/run.lock`` holding who owns the directory (pid, host, start time,
command) and keeps an exclusive ``flock`` on it while the run lasts; it removes the file on
exit (a normal end, an error, SIGTERM / Ctrl-C, which the train loop turns into exceptions).
A job killed outright (SIGKILL, a lost host) leaves the file behind, but the kernel drops its
``flock``: the next trainer finds the file unlocked, notes that it takes over a stale lock
and goes on. Where ``flock`` is not supported (some network file systems), a lock of this
host whose pid is gone is stale; one of another host is respected until deleted by hand.

A second trainer on a locked directory gets a `UsageError` naming the holder. In a
multi-process job only process 0 takes the lock (`RunLock(..., main=False)` does nothing).

>>> with RunLock(Path("runs/a")):       # doctest: +SKIP
...     pass                             # train into runs/a
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from shardax.errors import UsageError
from shardax.train.run import notes

__all__ = ["LOCK_FILE", "RunLock", "check_free"]

#: The lock file in a run directory.
LOCK_FILE = "run.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _holder(info: dict) -> str:
    """``pid 123 on host-a, started 2026-11-24T00:31:02Z: shardax train ...``"""
    if not info:
        return "a job that is starting (the lock file is still empty)"
    command = info.get("command", "")
    command = command if len(command) <= 120 else command[:117] + "..."
    return (f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started "
            f"{info.get('started', '?')}" + (f": {command}" if command else ""))


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        info = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):  # a damaged lock file: no holder to name
        return {}
    return info if isinstance(info, dict) else {}


def check_free(out: Path) -> None:
    """Raises the `UsageError` a `RunLock` of ``out`` would raise now, without taking it or
    writing anything (a check before anything else, so that the user hears first that the
    directory is in use). Only for a process that is not part of a multi-process job: the
    job's process 0 may hold the lock already."""
    path = Path(out) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (or unreadable: taking the lock will tell)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunLock(out)._refusal(_read(fd)) from None
    finally:
        os.close(fd)


class RunLock:
    """Holds ``<out>/run.lock`` while active; a second holder gets a `UsageError`.

    ``note`` hears of a stale lock taken over; ``main=False`` (a process other than 0 of a
    multi-process job) makes it a no-op. Creating the lock creates ``out``; a directory it
    created and that is still empty on release is removed again."""

    def __init__(self, out: Path, *, main: bool = True,
                 note: Callable[[str], None] | None = None):
        self.out, self.main = Path(out), main
        self.path = self.out / LOCK_FILE
        self.note = note or partial(notes.note, "train")
        self._fd: int | None = None
        self._created_out = False

    def __enter__(self) -> RunLock:
        if self.main and self._fd is None:
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Takes the lock, or raises `UsageError` naming the job that holds it."""
        try:
            self._created_out = not self.out.exists()
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {self.out}: cannot create it ({e.strerror or e})") from None
        for _ in range(10):  # the file may be replaced under us by a releasing holder
            if self.path.is_symlink():  # planted: replaced, never written through
                self.path.unlink(missing_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                stale = self._lock(fd)
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                    raise FileNotFoundError  # released and unlinked meanwhile: try again
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            break
        else:
            raise UsageError(f"--out {self.out}: cannot take the lock {self.path} (it keeps "
                             "being replaced)")
        self._fd = fd
        if stale:
            self.note(f"taking over the stale lock of {_holder(stale)} in {self.path} "
                      "(that job is gone)")
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "command": " ".join(["shardax", *sys.argv[1:]]) if sys.argv else ""}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)

    def _lock(self, fd: int) -> dict:
        """Locks ``fd``; returns the stale holder's info (empty when there was none)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._refusal(_read(fd)) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            return self._by_pid(fd)  # no flock here: decide from the pid
        return _read(fd)

    def _by_pid(self, fd: int) -> dict:
        info = _read(fd)
        if not info:
            return {}
        pid, host = info.get("pid"), info.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            return info
        raise self._refusal(info)

    def _refusal(self, info: dict) -> UsageError:
        return UsageError(
            f"--out {self.out} is in use by another shardax train ({_holder(info)}); wait for "
            f"it to end or choose another --out (if that job is gone, delete {self.path})")

    def release(self) -> None:
        """Removes the lock file and drops the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
        if self._created_out:
            with contextlib.suppress(OSError):
                self.out.rmdir()  # only if still empty: nothing was trained into it
