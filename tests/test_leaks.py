"""`mstrace leaks`: replaying hand-built memory tables (clean, leaked, reclaimed,
fragmented), and the stalls/leaks commands on a real tiny run."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import viewer.analysis.leak_fragmentation as frag_mod
import viewer.analysis.leak_replay as replay_mod
import viewer.analysis.leak_stream as stream_mod
from tests.support.cli import mstrace
from tests.support.leak_oracle import oracle_leak_report
from tracing.schema import MEMORY, REQUESTS
from viewer.analysis.leaks import (
    MAX_ANOMALIES,
    HeldBlocks,
    LeakReport,
    frag_point,
    largest_run,
    leak_report,
)

CAP = 10


def memory(rows: list[tuple]) -> pa.Table:
    """rows: (ts_ns, kind, block_id, request_id, ref_count); step = ts for simplicity."""
    cols = list(zip(*rows, strict=True)) if rows else [[]] * 5
    return pa.table({"ts_ns": cols[0], "step": cols[0], "kind": cols[1], "block_id": cols[2],
                     "request_id": cols[3], "ref_count": cols[4]}, schema=MEMORY)


def requests(done: dict[str, str]) -> pa.Table:
    return pa.table({"request_id": list(done), "finish_reason": list(done.values())},
                    schema=pa.schema([REQUESTS.field("request_id"), REQUESTS.field("finish_reason")]))


def test_clean_replay_reports_nothing():
    mem = memory([
        (1, "alloc", 0, "r1", 1), (2, "alloc", 1, "r1", 1),
        (3, "ref", 0, "r2", 2),  # r2 shares r1's prefix block
        (4, "alloc", 2, "r2", 1),
        (5, "free", 1, "r1", 0), (5, "unref", 0, "r1", 1),  # same ts: file order decides
        (6, "free", 2, "r2", 0), (6, "free", 0, "r2", 0),
        (7, "ref", 0, "r3", 1),  # a free prefix block revived by a ref
        (8, "free", 0, "r3", 0),
    ])
    rep = leak_report(mem, requests({"r1": "eos", "r2": "length", "r3": "eos"}), CAP, run_ended=True)
    assert rep.leaks == [] and rep.still_running == [] and rep.reclaimed == {}
    assert rep.num_anomalies == 0, rep.anomalies
    assert (rep.final_free, rep.final_held, rep.capacity, rep.events) == (CAP, 0, CAP, 10)
    assert rep.to_dict()["leaked_blocks"] == 0


def test_finished_request_still_holding_blocks_is_a_leak_with_exactly_its_blocks():
    mem = memory([
        (1, "alloc", 3, "r1", 1), (2, "alloc", 4, "r1", 1), (3, "alloc", 5, "r1", 1),
        (4, "ref", 4, "r2", 2), (5, "alloc", 6, "r2", 1),
        (6, "free", 6, "r2", 0), (6, "unref", 4, "r2", 1),  # r2 released everything
        (7, "free", 3, "r1", 0),  # r1 freed only one of its three blocks
        (8, "alloc", 7, "r9", 1),  # r9 never finished
    ])
    req = requests({"r1": "eos", "r2": "eos"})
    rep = leak_report(mem, req, CAP, run_ended=True)
    assert rep.leaks == [HeldBlocks("r1", "finished", "eos", [4, 5]), HeldBlocks("r9", "unknown", None, [7])]
    assert rep.leaked_blocks == 3 and rep.final_free == CAP - 3 and rep.num_anomalies == 0
    # A killed run: r9 was simply still running; r1 is finished, so still a leak.
    rep = leak_report(mem, req, CAP, run_ended=False)
    assert [h.request_id for h in rep.leaks] == ["r1"]
    assert rep.still_running == [HeldBlocks("r9", "running", None, [7])]


def test_reclaimed_blocks_are_reclaimed_not_leaked():
    mem = memory([
        (1, "alloc", 0, "r1", 1), (2, "alloc", 1, "r1", 1),
        (3, "ref", 0, "r2", 2), (4, "alloc", 2, "r2", 1),
        # The GC takes r2's references back: block 2 becomes free, shared block 0 keeps r1.
        (5, "reclaim", 2, "r2", 0), (5, "reclaim", 0, "r2", 1),
        (6, "free", 1, "r1", 0), (6, "free", 0, "r1", 0),
    ])
    rep = leak_report(mem, requests({"r1": "eos", "r2": "aborted"}), CAP, run_ended=True)
    assert rep.leaks == [] and rep.num_anomalies == 0, rep.anomalies
    assert rep.reclaimed == {"r2": [0, 2]} and rep.reclaimed_blocks == 2
    assert rep.final_free == CAP


def test_inconsistent_events_are_flagged_not_crashed_on():
    mem = memory([(1, "alloc", 0, "r1", 1), (2, "free", 0, "r1", 0), (3, "free", 0, "r1", 0),
                   (4, "unref", 5, "r4", 1), (5, "bogus", 1, "r1", 0)])
    rep = leak_report(mem, requests({"r1": "eos"}), CAP, run_ended=True)
    assert rep.num_anomalies == 3 and rep.leaks == []
    assert "already free" in rep.anomalies[0] and "does not hold" in rep.anomalies[1]


def test_fragmentation_on_a_hand_built_snapshot():
    held = [0, 1, 4, 5, 9]
    mem = memory(
        [(10, "snapshot_begin", -1, "", 5)] + [(10, "snapshot", b, "r1", 1) for b in held]
        + [(20, "alloc", 2, "r2", 1),  # held by the replay but not listed (e.g. behind a fence)
           (30, "snapshot_begin", -1, "", 4)] + [(30, "snapshot", b, "r1", 1) for b in held]
        + [(40, "free", 2, "r2", 0), (50, "snapshot_begin", -1, "", CAP)]
    )
    rep = leak_report(mem, requests({"r2": "eos"}), CAP, run_ended=True)
    f1, f2, f3 = rep.fragmentation
    # free {2,3,6,7,8}: ratio 0.5, largest run 6-8 = 3, index 1 - 3/5
    assert (f1.step, f1.free_blocks, f1.free_reported, f1.largest_free_run) == (10, 5, 5, 3)
    assert f1.free_ratio == pytest.approx(0.5) and f1.frag_index == pytest.approx(0.4)
    # free {3,6,7,8}: the replay's block 2 counts as held
    assert (f2.free_blocks, f2.free_reported, f2.largest_free_run) == (4, 4, 3)
    assert f2.frag_index == pytest.approx(0.25)
    # an empty pool: one run of everything, no fragmentation
    assert (f3.free_blocks, f3.largest_free_run, f3.frag_index, f3.free_ratio) == (CAP, CAP, 0.0, 1.0)
    assert rep.frag_range() == (0.0, pytest.approx(0.4))
    assert rep.events == 2 and rep.num_anomalies == 0  # snapshots change no state


def test_run_helpers():
    assert largest_run([]) == 0 and largest_run([5]) == 1 and largest_run([1, 2, 4, 5, 6, 9]) == 3
    full = frag_point(0, 0, [], 8)
    assert (full.free_blocks, full.frag_index, full.free_ratio) == (0, 0.0, 0.0)


def test_capacity_inferred_without_meta():
    rep = leak_report(memory([(1, "alloc", 6, "r1", 1), (2, "free", 6, "r1", 0)]), requests({}), 0, True)
    assert rep.capacity == 7 and rep.capacity_inferred and rep.final_free == 7


# ---------------------------------------------------------------- the CLI (tiny_trace: tests/conftest.py)
def test_leaks_on_a_tiny_run_finds_none(tiny_trace):
    p = mstrace("leaks", str(tiny_trace), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["leaks"] == [] and d["leaked_blocks"] == 0 and d["num_anomalies"] == 0, d["anomalies"]
    assert d["run_ended"] and d["events"] > 0 and d["final_free"] == d["capacity"] > 0
    assert d["fragmentation"] and 0.0 <= d["frag_index_min"] <= d["frag_index_max"] < 1.0
    # The replay agrees with the engine's own free count at every snapshot.
    assert all(f["free_blocks"] == f["free_reported"] for f in d["fragmentation"])
    p = mstrace("leaks", str(tiny_trace))
    assert p.returncode == 0, p.stderr
    assert "no leaks" in p.stdout and "fragmentation over" in p.stdout


def test_stalls_on_a_tiny_run_finds_none(tiny_trace):
    p = mstrace("stalls", str(tiny_trace), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["count"] == 0 and d["stalls"] == []
    p = mstrace("stalls", str(tiny_trace))
    assert p.returncode == 0 and "no stalls" in p.stdout


@pytest.mark.parametrize("cmd", ["stalls", "leaks"])
def test_missing_trace_is_one_line_exit_2(tmp_path, cmd):
    for args in ([str(tmp_path / "nope")], [str(tmp_path / "nope"), "--json"]):
        p = mstrace(cmd, *args)
        assert p.returncode == 2
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and "trace not found" in lines[0] and "Traceback" not in p.stderr


def test_stalls_and_leaks_do_not_import_torch_or_the_engine(tiny_trace):
    import subprocess
    import sys

    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom viewer.cli import app\n"
        f"for c in ('stalls', 'leaks'):\n    assert CliRunner().invoke(app, [c, {str(tiny_trace)!r}]).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('scheduler')))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


# ---------------------------------------------------------------- the vectorised replay vs the oracle
RIDS = ["r0", "r1", "r2", "r3", "r4", "", None]


class _Engine:
    """A toy block manager emitting memory rows, consistent unless told to misbehave."""

    def __init__(self, cap: int) -> None:
        self.cap, self.t, self.rows = cap, 0, []
        self.held: dict[int, dict[str, int]] = {}

    def emit(self, kind, bid, rid, ref) -> None:
        self.rows.append((self.t, kind, bid, rid, ref))

    def total(self, bid: int) -> int:
        return sum(self.held.get(bid, {}).values())

    def op(self, code: int, x: int, y: int) -> None:
        rid = RIDS[y % 5]
        held = sorted(self.held)
        if code <= 2:  # alloc a free block
            free = [b for b in range(self.cap) if b not in self.held]
            if free:
                b = free[x % len(free)]
                self.held[b] = {rid: 1}
                self.emit("alloc", b, rid, 1)
        elif code == 3:  # share a block (or revive a free one)
            b = held[x % len(held)] if held and x % 4 else x % self.cap
            h = self.held.setdefault(b, {})
            h[rid] = h.get(rid, 0) + 1
            self.emit("ref", b, rid, self.total(b))
        elif code in (4, 5, 6, 7) and held:  # a holder lets go: unref, free or reclaim
            b = held[x % len(held)]
            h = self.held[b]
            r = sorted(h)[y % len(h)]
            h[r] -= 1
            if not h[r]:
                del h[r]
            left = self.total(b)
            if not h:
                del self.held[b]
            self.emit("reclaim" if code == 7 else "free" if not left else "unref", b, r, left)
        elif code == 8:
            self.snapshot(x, y)

    def snapshot(self, x: int, y: int) -> None:
        if x % 5:  # else: snapshot rows with no snapshot_begin
            self.emit("snapshot_begin", -1, "", self.cap - len(self.held) + (y % 7 == 0))
        for b, h in sorted(self.held.items()):
            if (b + x) % 6:  # else: held behind a fence, unlisted
                for r, n in h.items():
                    self.emit("snapshot", b, r, n)
        if x % 11 == 0:  # a second begin at the same ts: the last one counts
            self.emit("snapshot_begin", -1, "", y % 4)

    def chaos(self, x: int, y: int, z: int) -> None:
        kinds = ["alloc", "ref", "unref", "free", "reclaim", "snapshot", "bogus", None]
        bid = None if z % 23 == 0 else (x % (self.cap + 2)) - (z % 13 == 0)
        self.emit(kinds[z % len(kinds)], bid, RIDS[y % len(RIDS)], None if z % 5 == 0 else (x + z) % 4)


@st.composite
def scenarios(draw):
    """(capacity, memory rows, finished requests): mostly a consistent engine, with a drawn share of bad rows."""
    cap = draw(st.integers(1, 9))
    chaos = draw(st.sampled_from([0.0, 0.0, 0.02, 0.2]))
    rnd = draw(st.randoms(use_true_random=False))
    eng = _Engine(cap)
    for _ in range(draw(st.integers(0, 250))):
        eng.t += rnd.choice((0, 0, 1, 2))  # 0: equal timestamps, decided by file order
        x, y, z = rnd.randrange(50), rnd.randrange(50), rnd.randrange(50)
        if rnd.random() < chaos:
            eng.chaos(x, y, z)
        else:
            eng.op(rnd.choices(range(9), weights=(3, 3, 3, 2, 2, 2, 2, 1, 1))[0], x, y)
    rows = eng.rows
    if draw(st.booleans()):  # file order differs from time order; equal timestamps stay in order
        keys = [rnd.randrange(1000) for _ in range(eng.t + 1)]
        rows = sorted(rows, key=lambda r: keys[r[0]])
    done = draw(st.dictionaries(st.sampled_from(RIDS[:5]), st.sampled_from(["eos", "length", "", None])))
    return cap, rows, done


def _memory_variant(rows: list[tuple], cuts: list[int], dict_rid: bool, plain_kind: bool) -> pa.Table:
    """The rows as a multi-chunk table (each chunk with its own dictionaries), in one of the column encodings."""
    schema = MEMORY
    if dict_rid:
        schema = schema.set(schema.get_field_index("request_id"), pa.field("request_id", pa.dictionary(pa.int32(), pa.string())))
    if plain_kind:
        schema = schema.set(schema.get_field_index("kind"), pa.field("kind", pa.string()))
    bounds = sorted({0, len(rows), *(c % (len(rows) + 1) for c in cuts)})
    parts = [memory(rows[a:b]).cast(schema) for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
    return pa.concat_tables(parts) if parts else memory([]).cast(schema)


def _requests(done: dict, dict_rid: bool = False) -> pa.Table:
    rid = pa.dictionary(pa.int32(), pa.string()) if dict_rid else pa.string()
    return pa.table({"request_id": list(done), "finish_reason": list(done.values())},
                    schema=pa.schema([("request_id", rid), REQUESTS.field("finish_reason")]))


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(-1, 3), st.booleans(), st.lists(st.integers(0, 200), max_size=3),
       st.booleans(), st.booleans(), st.integers(1, 40), st.sampled_from([None, None, None, 1, 2, 5, 17, 60]))
def test_vectorised_replay_equals_the_oracle(sc, dcap, run_ended, cuts, dict_rid, plain_kind, cells, window):
    """`window`: events per window (leak_stream.py); None, one window for the whole table."""
    cap, rows, done = sc
    win = {} if window is None else {"window_rows": window}
    capacity = 0 if dcap < 0 else cap + dcap - 1  # 0: inferred; else possibly below the largest block id
    mem, req = _memory_variant(rows, cuts, dict_rid, plain_kind), _requests(done, dict_rid)
    try:
        want = oracle_leak_report(mem, req, capacity, run_ended)
    except TypeError:  # null block ids among sorted ones: the replay fails, and so must we
        with pytest.raises(TypeError):
            leak_report(mem, req, capacity, run_ended, **win)
        return
    old, frag_mod.CHUNK_CELLS = frag_mod.CHUNK_CELLS, cells  # several fragmentation chunks
    try:
        got = leak_report(mem, req, capacity, run_ended, **win)
    finally:
        frag_mod.CHUNK_CELLS = old
    for f in fields(LeakReport):
        assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert got.to_dict() == want.to_dict()
    # The fast path sends a block to the exact replay only for a real anomaly (each has one at least).
    assert len(replay_mod.suspect(stream_mod.replay_state(mem)[2])) <= want.num_anomalies


def test_vectorised_replay_finds_anomalies_in_time_order_past_the_cap():
    """Many bad blocks: the count is exact, the messages are the first MAX_ANOMALIES in time order."""
    rows = []
    for t in range(2 * MAX_ANOMALIES):
        b = (t * 7) % 30  # interleaved blocks, so time order differs from block order
        rows += [(2 * t, "free", b, "r1", 0), (2 * t + 1, "bogus" if t % 9 == 0 else "unref", b + 100, "r2", 1)]
    mem, req = memory(rows), _requests({"r1": "eos"})
    got, want = leak_report(mem, req, 0, True), oracle_leak_report(mem, req, 0, True)
    assert got == want and got.num_anomalies == 4 * MAX_ANOMALIES and len(got.anomalies) == MAX_ANOMALIES


def test_block_order_slow_path_equals_the_packed_one():
    """Keys too wide for one int64 (vast block ids, many rows) take an argsort: same order."""
    rng = np.random.default_rng(0)
    bid, kind, rid = rng.integers(0, 5, 300), rng.integers(0, 5, 300).astype(np.int8), rng.integers(0, 9, 300)
    pos = np.sort(rng.choice(1000, 300, replace=False))
    packed = replay_mod._block_order(bid, pos, kind, rid, 9)
    slow = replay_mod._block_order(bid * (1 << 30), pos * (1 << 28), kind, rid, 9)
    assert np.array_equal(packed[0].astype(np.int64) << 28, slow[0]) and np.array_equal(packed[0], pos[np.lexsort((pos, bid))])
    assert all(np.array_equal(a, b) for a, b in zip(packed[1:3], slow[1:3], strict=True))
    assert np.array_equal(packed[3] * (1 << 30), slow[3]) and np.array_equal(packed[4], slow[4])


def test_counts_too_large_for_int16_cells():
    n = 1 << 15  # one shared block with more holders than an int16 matrix cell holds
    rows = [(0, "alloc", 2, "r0", 1)] + [(1 + i, "ref", 2, f"q{i}", i + 2) for i in range(n)]
    rows += [(n + 1, "snapshot_begin", -1, "", CAP - 1), (n + 2, "unref", 2, "r0", n)]
    mem, req = memory(rows), _requests({"r0": "eos"})
    got, want = leak_report(mem, req, CAP, True), oracle_leak_report(mem, req, CAP, True)
    assert got == want and got.fragmentation[0].free_blocks == CAP - 1 and got.num_anomalies == 0


def test_holder_counts_fold_kinds_as_dictionary_codes_and_skip_nulls() -> None:
    """viewer/analysis/holders.py (the export's leak count and `mstrace top`'s): +1 for
    alloc/ref, -1 for free/unref/reclaim, a request at 0 dropped; a null kind or request id
    counts for nobody; with `restart`, the last snapshot's listing starts the counts over."""
    from viewer.analysis.holders import fold_holders

    kinds = ["alloc", "alloc", "ref", None, "free", "alloc", "unref", "reclaim", "alloc", "alloc"]
    rids = ["a", "a", "b", "a", "a", "c", "b", "c", None, "d"]
    for as_dict in (False, True):
        k, r = pa.array(kinds), pa.array(rids)
        mem = pa.table({"kind": k.dictionary_encode() if as_dict else k, "request_id": r.dictionary_encode() if as_dict
                        else r})
        held: dict[str, int] = {"d": 1}
        fold_holders(mem, held)
        assert held == {"a": 1, "d": 2}
    mem = pa.table({"kind": ["alloc", "snapshot_begin", "snapshot", "snapshot", "alloc"],
                    "request_id": ["x", "", "y", "y", "z"]})
    held = {"x": 5}
    rows, restarted = fold_holders(mem, held, restart=True)
    assert restarted and rows.num_rows == 3 and held == {"y": 2, "z": 1}
