"""`mstrace leaks` reads a trace's memory events a window at a time (viewer/analysis/leak_stream.py):
the report equals the whole-table replay's, exactly, whatever the windows and the row groups'
order on disk; memory follows the window, not the trace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.tiny_runs import TinyRuns
from tracing.consistency import read_consistent
from tracing.reader import Trace
from tracing.writer import parquet_options
from viewer.analysis.leaks import build_leaks, leak_report

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "traces"


def _variant(src: Path, dst: Path, rows: int, scramble: bool, forget_capacity: bool) -> Path:
    """A copy of a trace whose memory parts are rewritten in row groups of `rows` rows;
    `scramble`: runs of 5 rows in reverse order, so the row groups' time order is not the
    file order and equal timestamps meet across groups; `forget_capacity`: meta.json without
    kv_blocks (an older trace: the capacity is the largest block id + 1)."""
    shutil.copytree(src, dst)
    for part in (dst / "memory").glob("*.parquet"):
        t = pq.read_table(part)
        if scramble:
            runs = [t.slice(a, 5) for a in range(0, t.num_rows, 5)]
            t = pa.concat_tables(runs[::-1])
        pq.write_table(t, part, row_group_size=rows, **parquet_options(t.schema))
    if forget_capacity:
        meta = json.loads((dst / "meta.json").read_text())
        meta.get("model", {}).pop("kv_blocks", None)
        (dst / "meta.json").write_text(json.dumps(meta))
    return dst


def _whole(root: Path):
    tr = Trace.open(root)
    t = read_consistent(tr, {"memory": None, "requests": ["request_id", "finish_reason"]})
    cap = int(tr.meta.get("model", {}).get("kv_blocks") or 0)
    return leak_report(t["memory"], t["requests"], cap, run_ended=tr.status.complete), tr.status.clipped


@pytest.fixture(scope="module")
def leaky(tiny_runs: TinyRuns) -> Path:
    # the session's leak run (test_json_docs, test_stalls, test_export)
    return tiny_runs("--requests", "16", "--inject", "leak", "--no-gc", "--snapshot-every", "4", "-q").out


@pytest.mark.parametrize("sample", ["sample-serial", "sample-overlap", "sample-deadlock", "leak"])
@pytest.mark.parametrize("rows,scramble,forget", [(3, False, False), (4, True, False), (3, True, True)])
def test_windows_of_any_size_give_the_whole_replays_report(sample: str, rows: int, scramble: bool, forget: bool,
                                                           leaky: Path, tmp_path: Path) -> None:
    """Serial and overlap runs, a deadlocked one (unfinished) and one that leaks blocks, from
    one window per row group to one for all (clipping: the test after this one)."""
    src = leaky if sample == "leak" else SAMPLES / sample
    root = _variant(src, tmp_path / sample, rows, scramble, forget)
    want, clipped = _whole(root)
    assert want.events > 40, "the trace has memory events"
    if sample == "leak":
        assert want.leaks and len(want.fragmentation) > 10, "blocks held across many windows"
    # one event a window on the small samples; the leak run's 4,452 events in a few hundred
    for window in (13, 200, 1 << 21) if sample == "leak" else (1, 7, 50, 1 << 21):
        tr = Trace.open(root)
        got = build_leaks(tr, str(root), window_rows=window).report
        assert got == want, (sample, window)
        assert tr.status.clipped == clipped


def test_the_windows_read_follow_the_window_not_the_trace(leaky: Path, tmp_path: Path) -> None:
    """A window holds the rows of the groups it read up to its cut, and a timestamp's rows stay
    together (a snapshot is many rows at one ts_ns): what is read at once follows the window
    and the longest run of one timestamp, not the trace."""
    root = _variant(leaky, tmp_path / "s", 3, False, False)
    from viewer.analysis import leak_stream

    ts = read_consistent(Trace.open(root), {"memory": ["ts_ns"]})["memory"]["ts_ns"].to_numpy()
    total, longest = len(ts), int(np.unique(ts, return_counts=True)[1].max())
    seen: list[int] = []
    real_feed = leak_stream.WindowedReplay.feed

    def feed(self: leak_stream.WindowedReplay, window: pa.Table) -> None:
        seen.append(window.num_rows)
        real_feed(self, window)

    leak_stream.WindowedReplay.feed = feed  # type: ignore[method-assign]
    try:
        build_leaks(Trace.open(root), str(root), window_rows=50)
    finally:
        leak_stream.WindowedReplay.feed = real_feed  # type: ignore[method-assign]
    assert sum(seen) == total and len(seen) >= total // (50 + 3 + longest)
    assert max(seen) <= 50 + 3 + longest  # whole groups of 3 rows, then one timestamp's rows
    assert 50 + 3 + longest < total // 4


def test_a_part_that_vanishes_mid_read_starts_the_replay_over(leaky: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A live compaction can remove a committed part while `leaks` reads it: the replay starts
    over on a newer snapshot (tracing/sweep.py `start_over`), with the same report; a part that
    stays gone is one error, not a traceback."""
    import tracing.sweep as sweep_mod
    from tracing.reader import TraceError

    root = _variant(leaky, tmp_path / "v", 3, False, False)
    want, _ = _whole(root)
    real = sweep_mod.read_row_groups
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # mid-way: some windows already replayed
            raise FileNotFoundError(2, "gone", "part-x.parquet")
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep_mod, "read_row_groups", flaky)
    assert build_leaks(Trace.open(root), str(root), window_rows=50).report == want
    assert calls["n"] > 5

    def gone(*args, **kwargs):
        raise FileNotFoundError(2, "gone", "part-x.parquet")

    monkeypatch.setattr(sweep_mod, "read_row_groups", gone)
    with pytest.raises(TraceError, match="memory/ table .* which is missing"):
        build_leaks(Trace.open(root), str(root), window_rows=50)


def _manifest_rows(root: Path, table: str, part: Path) -> None:
    """The manifest's committed row count and size of `part`, as rewritten."""
    m = json.loads((root / "manifest.json").read_text())
    for e in m["tables"][table]:
        if e["file"] == part.name:
            e["rows"], e["nbytes"] = pq.ParquetFile(part).metadata.num_rows, part.stat().st_size
    (root / "manifest.json").write_text(json.dumps(m))


def test_an_unfinished_runs_late_events_are_clipped_and_counted_once(tmp_path: Path) -> None:
    """The deadlocked sample with memory events of a round past its last committed one (what
    a killed run leaves): clipped, as a whole read clips them, and counted once although the
    inferred capacity reads the table a second time."""
    for forget in (False, True):
        root = _variant(SAMPLES / "sample-deadlock", tmp_path / f"late{forget}", 3, False, forget)
        part = next((root / "memory").glob("*.parquet"))
        t = pq.read_table(part)
        last = t.slice(t.num_rows - 1)
        step = max(pq.read_table(next((root / "steps").glob("*.parquet")))["step"].to_pylist())
        late = pa.concat_tables([last] * 4).to_pydict()
        late["step"] = [step + 1] * 4
        late["ts_ns"] = [v + 1000 * (i + 1) for i, v in enumerate(late["ts_ns"])]
        late["block_id"] = [4000 + i for i in range(4)]  # larger than any kept: the capacity must not see them
        pq.write_table(pa.concat_tables([t, pa.table(late, schema=t.schema)]), part, row_group_size=3,
                       **parquet_options(t.schema))
        _manifest_rows(root, "memory", part)
        want, clipped = _whole(root)
        assert clipped == {"memory": 4} and (not forget or want.capacity < 4000)
        tr = Trace.open(root)
        assert build_leaks(tr, str(root), window_rows=7).report == want
        assert tr.status.clipped == clipped


def test_no_memory_table_and_negative_block_ids(tmp_path: Path) -> None:
    """A trace whose memory/ table is missing is one error, as before the windows; block ids
    that are all negative and no kv_blocks give capacity 0, as the whole-table replay does."""
    from tracing.reader import TraceError

    root = _variant(SAMPLES / "sample-serial", tmp_path / "neg", 3, False, True)
    part = next((root / "memory").glob("*.parquet"))
    t = pq.read_table(part)
    t = t.set_column(t.schema.get_field_index("block_id"), "block_id",
                     pa.array([-5 - i for i in range(t.num_rows)], pa.int32()))
    pq.write_table(t, part, row_group_size=3, **parquet_options(t.schema))
    _manifest_rows(root, "memory", part)
    want, _ = _whole(root)
    got = build_leaks(Trace.open(root), str(root), window_rows=7).report
    assert got == want and got.capacity == 0
    shutil.rmtree(root / "memory")
    with pytest.raises(TraceError, match="no memory/ table"):
        build_leaks(Trace.open(root), str(root))


def test_a_replay_started_over_on_a_newer_snapshot_clips_by_that_snapshots_rounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`leaks` opened a live trace at its second commit; two more were committed and
    compacted, and a part it read went missing: it starts over on the newer snapshot, and
    clips the memory events by that snapshot's rounds too. It clipped by the first one's,
    dropping the later rounds' frees beside the newer requests table: false leaks, exit 1."""
    import tracing.sweep as sweep_mod
    from tests.support.tui_trace import synthetic_trace

    opened: list[Trace] = []
    root = synthetic_trace(tmp_path / "t", rounds=60, requests=12, complete=False, flushes=4,
                           on_flush=lambda k: opened.append(Trace.open(tmp_path / "t")) if k == 2 else None)
    fresh = build_leaks(Trace.open(root), str(root)).report
    assert not fresh.leaks and fresh.events > 40
    real, calls = sweep_mod.read_row_groups, {"n": 0}

    def vanished_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FileNotFoundError(2, "gone", "part-x.parquet")
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep_mod, "read_row_groups", vanished_once)
    assert build_leaks(opened[0], str(root)).report == fresh and calls["n"] > 1


def test_a_reclaim_row_without_a_block_is_a_corrupt_table_error(tmp_path: Path) -> None:
    """A `reclaim` row whose block id is null (a damaged part): one TraceError naming the
    table, as other disorder is, not a traceback from the report's reclaim pass."""
    from tracing.reader import TraceError

    root = _variant(SAMPLES / "sample-serial", tmp_path / "null", 3, False, False)
    part = next((root / "memory").glob("*.parquet"))
    t = pq.read_table(part)
    last = t.slice(t.num_rows - 1).to_pydict()
    extra = {**last, "ts_ns": [last["ts_ns"][0] + 1, last["ts_ns"][0] + 2], "kind": ["reclaim", "reclaim"],
             "block_id": [None, 3], "ref_count": [0, 0]}
    extra = {k: (v * 2 if len(v) == 1 else v) for k, v in extra.items()}
    pq.write_table(pa.concat_tables([t, pa.table(extra, schema=t.schema)]), part, **parquet_options(t.schema))
    _manifest_rows(root, "memory", part)
    with pytest.raises(TraceError, match="corrupt memory/ table"):
        build_leaks(Trace.open(root), str(root))
    from viewer.tui.view_data import TraceBrowser

    assert "corrupt memory/ table" in TraceBrowser(root).leaks_text(100).plain  # `view`'s leaks tab
