"""SIGKILL at any moment: of a run (at many offsets, not only after its first flush)
and of `mstrace compact`. Every analysis must read what was committed, say it is
truncated, and never see a row the commit did not include."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import REPO, TAG, cli, start_mstrace, tagged_pids
from tracing.compaction import Targets
from tracing.manifest import read_manifests
from tracing.reader import Trace

RUN = ["run", "--model", "tiny", "--requests", "160", "--output-len", "40-160", "--prompt-len", "16-128",
       "--rate", "80", "-q"]
KILLS = 10  # offsets spread over the run
MAX_TRIES = 14  # a run that finishes before its kill is not a kill: try another offset, this many at most
KILLS_COMPACT = 6


def _start(out: Path, tag: str, cpu_device: str, mode: str = "serial") -> Any:
    return start_mstrace(*RUN, "--cpu-device", cpu_device, "--mode", mode, "--out", str(out),
                         env={**os.environ, TAG: tag})


def _ended(out: Path) -> bool:
    """The end-of-run record is written: a kill after it kills a finished run."""
    try:
        return "run" in json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return False


def _wait_for(path: Path, proc: Any, limit_s: float = 120) -> float:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert proc.poll() is None, "the run ended before it wrote a manifest"
        assert time.monotonic() < deadline, "the run never started writing"
        time.sleep(0.005)
    return time.monotonic()


def _first_line(text: str) -> str:
    return next((ln for ln in text.splitlines() if ln.strip()), "")


@pytest.mark.slow
def test_sigkill_at_ten_offsets_leaves_consistent_truncated_traces(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    proc = _start(ref, uuid.uuid4().hex, "thread")
    t0 = _wait_for(ref / "meta.json", proc)
    while not _ended(ref):
        assert proc.poll() is None or _ended(ref), "the reference run ended without its record"
        time.sleep(0.005)
    span = time.monotonic() - t0  # from the first meta.json to the end-of-run record
    assert proc.wait(timeout=300) == 0
    assert Trace.open(ref).status.complete
    fractions = [0.02 + 0.9 * i / (KILLS - 1) for i in range(KILLS)]
    kills = tries = 0
    while kills < KILLS and tries < MAX_TRIES:
        frac = fractions[kills]
        tries += 1
        out, tag = tmp_path / f"k{tries}", uuid.uuid4().hex
        # two runs with a device process (it must not outlive the kill), the rest start faster
        cpu_device = "process" if tries in (2, 7) else "thread"
        # overlap mode too: split streams free a finished request's blocks behind the KV fence
        proc = _start(out, tag, cpu_device, "overlap" if tries % 2 else "serial")
        t = _wait_for(out / "meta.json", proc)
        if cpu_device == "process":  # the scan sees the run's processes (positive control): the
            assert len(tagged_pids(tag)) >= 2  # device process is forked before meta.json is written
        kill_at = t + frac * span
        while time.monotonic() < kill_at and not _ended(out):
            time.sleep(0.005)
        if _ended(out):  # it finished first: this host is faster now than for the reference run,
            span = min(span, time.monotonic() - t)  # so the offsets follow this run's span
            assert proc.wait(timeout=300) == 0
            continue
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.returncode != -signal.SIGKILL or _ended(out):
            assert proc.returncode in (0, -signal.SIGKILL)
            continue  # it finished as it was killed (perhaps while it printed its report)
        kills += 1
        # The device process sees its pipe close and exits; killed while it still imports torch
        # or loads weights, it first finishes those. Beside a CPU hog with three workers on two
        # cores that took more than 5 s (ci36): the bound is on outliving, not on speed.
        deadline = time.monotonic() + 60
        while tagged_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tagged_pids(tag), "the device process outlived a killed run"
        _check_truncated(out, ref, frac)
    assert kills == KILLS, f"only {kills} of {tries} runs were killed before they finished"


def _check_truncated(out: Path, ref: Path, frac: float) -> None:
    where = f"killed at {frac:.0%} of the run ({out})"
    code, stdout, stderr = cli("report", str(out), "--json")
    assert code == 0, (where, stderr)
    rep = json.loads(stdout)
    st = rep["status"]
    assert st["state"] == "truncated" and not st["live"], where
    # The engine hands a round's tokens to the sender only after its steps row, and a
    # flush drains requests before steps: no committed request names a missing round.
    assert st["clipped"].get("requests", 0) == 0, (where, st)
    # (all 160 may be committed: a kill during the last flush's compaction, before the record)
    assert rep["throughput"]["requests"] <= 160, where
    for cmd in (["report", str(out)], ["stalls", str(out)], ["leaks", str(out)], ["diff", str(ref), str(out)]):
        code, stdout, stderr = cli(*cmd)
        assert code == 0 and "Traceback" not in stderr, (where, cmd, stderr)
        assert "TRUNCATED" in _first_line(stdout), (where, cmd, stdout[:300])
    code, stdout, _ = cli("leaks", str(out), "--json")
    leaks = json.loads(stdout)
    # requests are drained before memory: a finished request's frees are always committed with it
    assert leaks["leaked_blocks"] == 0 and leaks["num_anomalies"] == 0, (where, leaks["leaks"][:3])


def _uncompacted(root: Path, parts: int) -> None:
    """A killed long run's layout: many committed one-flush parts, never merged."""
    import pyarrow as pa

    from tests.support.store import probe_row
    from tracing.manifest import Manifest
    from tracing.schema import PROBES, TABLES
    from tracing.writer import PartStore, write_json_atomic

    for t in TABLES:
        (root / t).mkdir(parents=True)
    store = PartStore(root, Manifest(0), TABLES, Targets())
    rows = [dict(zip(PROBES.names, probe_row(i), strict=True)) for i in range(50 * parts)]
    store.commit({"probes": [store.write_part("probes", pa.Table.from_pylist(rows[50 * i:50 * (i + 1)],
                                                                            schema=PROBES))
                             for i in range(parts)]})
    write_json_atomic(root / "meta.json", {"schema_version": 1, "store": "manifest-v1",
                                           "model": {"kv_blocks": 4}})


def _committed_rows(root: Path) -> dict[str, int]:
    return {t: sum(e.rows for e in es) for m in read_manifests(root) for t, es in m.tables.items()}


@pytest.mark.slow
def test_sigkill_during_compact_loses_and_duplicates_no_row(tmp_path: Path) -> None:
    base = tmp_path / "base"
    _uncompacted(base, 700)
    want_rows = _committed_rows(base)
    want = Trace.open(base).table("probes", ["step"])["step"].to_pylist()
    # Kills are placed by what compact has done so far, not by a clock (a loaded machine
    # stretches its start-up, and a calibrated sleep then lands after it finished):
    # 0: a new part is on disk, not yet committed; 1: the manifest committed it;
    # 2: the merged sources are being removed. Polled every ms; a compact can still
    # finish between the poll and the kill, so a few may end on their own.
    base_files = set(os.listdir(base / "probes"))
    base_manifest = (base / "manifest.json").read_bytes()

    def reached(t_dir: Path, phase: int) -> bool:
        files = set(os.listdir(t_dir / "probes"))
        if phase == 0:
            return bool(files - base_files)
        if phase == 1:
            return (t_dir / "manifest.json").read_bytes() != base_manifest
        return len(files & base_files) < len(base_files)

    killed = 0
    for i in range(KILLS_COMPACT):
        t_dir = tmp_path / f"c{i}"
        shutil.copytree(base, t_dir)
        proc = subprocess.Popen([sys.executable, "-m", "viewer.cli", "compact", str(t_dir)], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while proc.poll() is None and not reached(t_dir, i % 3) and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        killed += proc.returncode == -signal.SIGKILL
        assert _committed_rows(t_dir) == want_rows, f"kill {i}"  # none lost, none duplicated
        assert Trace.open(t_dir).table("probes", ["step"])["step"].to_pylist() == want, f"kill {i}"
        code, _, stderr = cli("compact", str(t_dir))  # and it finishes afterwards
        assert code == 0, stderr
        assert Trace.open(t_dir).table("probes", ["step"])["step"].to_pylist() == want
    assert killed >= KILLS_COMPACT // 2, f"only {killed} of {KILLS_COMPACT} compactions were still running when killed"
