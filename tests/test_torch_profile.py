"""Two instruments, one run: `mstrace run --torch-profile DIR` records the run with torch.profiler
as well as with the probes, and `mstrace import DIR` gives a host view whose rows agree with
the probe report's (docs/import.md)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import mstrace

# The acceptance's bound: each host-view row within 2 percentage points of the probe report's.
BOUND_PP = 2.0


def host_shares(report: dict) -> dict[str, float]:
    return {b["boundary"]: b["host_share"] for b in report["boundaries"] if b["host_share"] is not None}


@pytest.mark.parametrize("mode,device", [("serial", "thread"), ("overlap", "thread"), ("serial", "process"),
                                         ("overlap", "process")])
def test_the_profilers_host_view_agrees_with_the_probes(tmp_path, mode, device):
    # two instruments on one run; the profiler's own cost lands in its ranges, and more of it on
    # a loaded host (a CI run beside other work read the barrier 2.2 points apart): up to two
    # fresh runs before the bound is called missed
    misses = []
    for attempt in range(3):
        run, prof, imp = (tmp_path / f"{name}{attempt}" for name in ("run", "prof", "imp"))
        p = mstrace("run", "--model", "tiny", "--requests", "24", "--mode", mode, "--cpu-device", device, "-q",
                    "--out", str(run), "--torch-profile", str(prof))
        assert p.returncode == 0, p.stderr
        assert "torch.profiler: wrote" in p.stderr and "% of the run" in p.stderr  # its cost is said, not hidden
        cost = json.loads((run / "meta.json").read_text())["run"]["torch_profile"]
        assert cost["ranges"] > 0 and cost["range_ns"] > 0
        p = mstrace("import", str(prof), "--round", "^mstrace::round$", "--out", str(imp))
        assert p.returncode == 0, p.stderr
        probe = json.loads(mstrace("report", str(run), "--json").stdout)
        prof_rep = json.loads(mstrace("report", str(imp), "--json").stdout)
        a, b = host_shares(probe), host_shares(prof_rep)
        assert {"scheduler_barrier", "batch_prepare", "bookkeeping", "response_send", "unattributed"} <= set(b)
        off = {row: 100 * (a.get(row, 0.0) - b.get(row, 0.0)) for row in set(a) | set(b)}
        if all(abs(d) <= BOUND_PP for d in off.values()):
            break
        misses.append(off)
    assert len(misses) < 3, misses
    # every probe-report round is a profiler round; the profiler has more where a round had
    # nothing to do (scheduler/harness/torch_profile.py), and how many depends on the
    # machine's load (a fixed bound of 3 failed with 4 when three workers shared 2 cores)
    assert prof_rep["cycles"] >= probe["cycles"]
    # on the wall clock both traces start the run together: the import moved the profiler's
    # times by its file's baseTimeNanoseconds (Kineto writes ts relative to it)
    base = json.loads((prof / "rank0.pt.trace.json").read_text())["baseTimeNanoseconds"]
    m_run, m_imp = (json.loads((d / "meta.json").read_text()) for d in (run, imp))
    assert m_imp["clock"]["anchor_unix_ns"] == base
    unix_run = m_run["run"]["start_ns"] - m_run["clock"]["anchor_monotonic_ns"] + m_run["clock"]["anchor_unix_ns"]
    unix_imp = m_imp["run"]["start_ns"] - m_imp["clock"]["anchor_monotonic_ns"] + m_imp["clock"]["anchor_unix_ns"]
    assert abs(unix_imp - unix_run) < 1_000_000_000, (unix_imp - unix_run) / 1e9


def test_mode_all_writes_a_profile_per_mode_and_a_file_is_not_a_folder(tmp_path):
    """--mode all wrote its three profiles to one DIR/rank0.pt.trace.json (the serial and
    time-slice ones overwritten, while their meta.json named it); a --torch-profile that
    is a file failed after the model loaded (exit 4): one line before anything runs."""
    import json

    from tests.support.cli import mstrace

    prof, out = tmp_path / "prof", tmp_path / "t"
    p = mstrace("run", "--model", "tiny", "--requests", "4", "--mode", "all", "--torch-profile", str(prof),
                "--out", str(out), "-q", timeout=300)
    assert p.returncode == 0, p.stderr
    for mode in ("serial", "timeslice", "overlap"):
        f = json.loads((out / mode / "meta.json").read_text())["run"]["torch_profile"]["file"]
        assert f == str(prof / mode / "rank0.pt.trace.json") and (prof / mode / "rank0.pt.trace.json").is_file()
    afile = tmp_path / "afile"
    afile.write_text("x")
    p = mstrace("run", "--model", "tiny", "--requests", "2", "--torch-profile", str(afile), "--out",
                str(tmp_path / "u"), "-q")
    assert p.returncode == 2 and "is a file" in p.stderr and len(p.stderr.strip().splitlines()) == 1
