"""Who is writing a trace: one advisory lock file per writing rank.

A writer holds an exclusive flock on `.writer-r<rank>.lock` for its lifetime.
The kernel drops it when the process dies, however it dies, so a reader can tell
a trace still being written (the lock is held) from one whose writer was killed
(the file is there, unlocked), and `mstrace compact` refuses to touch a live one.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


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
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return cls(fd)
            except BlockingIOError:
                time.sleep(0.01)
        os.close(fd)
        raise RuntimeError(f"trace {root} is being written by another process (rank {rank})")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def live_ranks(root: Path) -> list[int]:
    """Ranks whose writer still holds its lock: the trace is being written now."""
    out = []
    for p in sorted(root.glob(".writer-r*.lock")):
        try:
            rank = int(p.name[len(".writer-r"):-len(".lock")])
            fd = os.open(p, os.O_RDONLY)
        except (ValueError, OSError):
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            out.append(rank)
        finally:
            os.close(fd)  # also drops the shared lock, if it was taken
    return out
