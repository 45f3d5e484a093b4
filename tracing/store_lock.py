"""Who is writing a trace: one advisory lock file per writing rank.

A writer holds an exclusive flock on `.writer-r<rank>.lock` for its lifetime.
The kernel drops it when the process dies, however it dies, so a reader can tell
a trace still being written (the lock is held) from one whose writer was killed
(the file is there, unlocked), and `mstrace compact` refuses to touch a live one.

POSIX: flock. Windows: msvcrt's byte-range lock on the file's first byte, which the
system also drops with the process; it has no shared mode, so a reader's probe takes it
exclusively for microseconds, and a writer retries past it as it does past flock's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

if sys.platform == "win32":
    import msvcrt

    def _try_lock(fd: int, exclusive: bool) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock(fd: int) -> None:
        try:
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        except OSError:
            pass
else:
    import fcntl

    def _try_lock(fd: int, exclusive: bool) -> bool:
        """The lock taken without blocking; False when another process holds it."""
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(fd: int) -> None:
        pass  # closing the descriptor drops the flock


@contextmanager
def exclusive(path: Path, timeout_s: float) -> Iterator[None]:
    """`path`'s lock held for the block, by this process alone: other processes wait (up to
    `timeout_s`, then RuntimeError). Dropped by the kernel if the process dies in the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while not _try_lock(fd, exclusive=True):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} is held by another process for more than {timeout_s:.0f} s")
            time.sleep(0.05)
        try:
            yield
        finally:
            _unlock(fd)
    finally:
        os.close(fd)


def lock_path(root: Path, rank: int) -> Path:
    return root / f".writer-r{rank}.lock"


class WriterLock:
    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, root: Path, rank: int) -> WriterLock:
        fd = os.open(lock_path(root, rank), os.O_RDWR | os.O_CREAT, 0o644)
        # A reader's probe (`live_ranks`) holds the lock shared for microseconds: retry past it.
        for _ in range(100):
            if _try_lock(fd, exclusive=True):
                return cls(fd)
            time.sleep(0.01)
        os.close(fd)
        raise RuntimeError(f"trace {root} is being written by another process (rank {rank})")

    def release(self) -> None:
        if self._fd is not None:
            _unlock(self._fd)
            os.close(self._fd)
            self._fd = None


def live_ranks(root: Path) -> list[int]:
    """Ranks whose writer still holds its lock: the trace is being written now."""
    out = []
    for p in sorted(root.glob(".writer-r*.lock")):
        try:
            rank = int(p.name[len(".writer-r"):-len(".lock")])
            fd = os.open(p, os.O_RDWR if sys.platform == "win32" else os.O_RDONLY)
        except (ValueError, OSError):
            continue
        try:
            if _try_lock(fd, exclusive=False):
                _unlock(fd)
            else:
                out.append(rank)
        finally:
            os.close(fd)
    return out
