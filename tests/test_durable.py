"""Commits survive a crash of the machine: each part's data, its folder, the manifest and the
trace folder are fsynced in order, and merged parts are removed only after the commit that
let them go is on disk (tracing/durable.py). Recorded by wrapping the os calls."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tracing.compaction import Targets
from tracing.writer import TraceWriter


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(what, path) of every fsync, rename and removal, in order."""
    log: list[tuple[str, str]] = []
    fsync, replace, unlink = os.fsync, os.replace, Path.unlink

    def rec_fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def rec_replace(a: os.PathLike[str] | str, b: os.PathLike[str] | str) -> None:
        log.append(("replace", str(b)))
        replace(a, b)

    def rec_unlink(self: Path, missing_ok: bool = False) -> None:
        log.append(("unlink", str(self)))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "fsync", rec_fsync)
    monkeypatch.setattr(os, "replace", rec_replace)
    monkeypatch.setattr(Path, "unlink", rec_unlink)
    return log


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd's file through /proc")
def test_a_commit_is_part_fsync_manifest_fsync_folder_fsync_then_removals(tmp_path, calls):
    root = tmp_path / "t"
    # a merge after four parts of one table: the removals come after the commit that dropped them
    w = TraceWriter(root, flush_interval_s=3600, targets=Targets(fan_in=4))
    buf = w.buffer("probes")
    start = len(calls)
    for i in range(4):
        buf.append((i, 1, "bookkeeping", "host", 0, i))
        w.flush()
        w._store.compact(final=False)
    log = [(what, Path(p)) for what, p in calls[start:]]
    w.close()
    probes, manifest = root / "probes", root / "manifest.json"

    def at(what: str, cond: object) -> list[int]:
        return [i for i, (w_, p) in enumerate(log) if w_ == what and cond(p)]  # type: ignore[operator]

    parts = at("replace", lambda p: p.parent == probes)
    commits = at("replace", lambda p: p == manifest)
    assert len(parts) == 5 and len(commits) == 5  # four flushes and one merge, each committed
    for part in parts:
        # the part's data before its rename; its folder after it, before the manifest that names it
        assert log[part - 1][0] == "fsync" and log[part - 1][1].name.endswith(".tmp")
        nxt = min(c for c in commits if c > part)
        assert any(i for i in at("fsync", lambda p: p == probes) if part < i < nxt)
    for c in commits:
        assert log[c - 1][0] == "fsync" and log[c - 1][1].name == ".manifest.json.tmp"  # the manifest's data
        assert log[c + 1] == ("fsync", root)  # then the trace folder: the commit point
    gone = at("unlink", lambda p: p.parent == probes)
    assert len(gone) == 4 and min(gone) > commits[-1] + 1  # the merged parts go only after it
