"""Writes that survive a crash of the machine, not only of the process.

A rename is atomic against a killed process, but on a power cut or a VM reset the kernel
may not yet have written the file's data, or the directory entry the rename made. So a
commit is ordered, each step on disk before the next begins:
  1. each new part: write a temporary file, fsync it, rename it into place;
  2. fsync each table folder that gained a part (the new names are on disk);
  3. the manifest: write a temporary file, fsync it, rename it over the old one;
  4. fsync the trace folder (the manifest's new name is on disk): the commit point;
  5. only then remove the files the commit let go (merged parts).
A crash at any point leaves the previous commit intact: before 4, the old manifest names
only parts that were already durable; after 4, the new one does. fsync is an I/O wait, not
CPU: BENCHMARKS.md "Durable commits" measures what it adds to a flush and to the probes'
CPU budget.
"""

from __future__ import annotations

import os
from pathlib import Path

# Windows' fsync (`_commit`, FlushFileBuffers) needs a handle that may write; POSIX fsyncs
# any descriptor, and a read-only one opens even a file the process may not write.
_FSYNC_OPEN = os.O_RDWR if os.name == "nt" else os.O_RDONLY


def fsync_file(path: Path) -> None:
    fd = os.open(path, _FSYNC_OPEN)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """The folder's entries (a rename into it, a new file) on disk. Not every platform can
    open a folder (Windows): there a rename is as durable as the file system makes it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, final: Path) -> None:
    """tmp's data on disk, then its rename to final (the folder's fsync is the caller's: one
    per commit, not one per file)."""
    fsync_file(tmp)
    os.replace(tmp, final)
