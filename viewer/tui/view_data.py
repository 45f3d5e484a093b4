"""What `mstrace view` browses: a finished (or truncated) trace read once, as rounds,
requests, and the detail of one round or one request.

The per-round costs are the report's `per_cycle` (both views) for every round, so a
round sorted to the top by a boundary's cost is the one the cost table blames.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.text import Text

from probes import boundaries as B
from tracing.consistency import read_consistent
from tracing.reader import Trace
from tracing.schema import TABLES
from viewer.analysis.cycle_views import per_cycle
from viewer.analysis.order import natural_key
from viewer.export.window import Window, table_in, window_cycles
from viewer.tui.round_screen import RequestDetail, RoundDetail

ROUND_COLS = ("step", "ms", "prefill", "prefill tok", "decode", "blocks", "waiting")
REQUEST_COLS = ("request", "prompt", "output", "TTFT ms", "max ITL ms", "E2E ms", "preempt", "finish")


@dataclass(slots=True)
class Rounds:
    columns: list[str]  # ROUND_COLS, then one "<boundary> ms" per boundary (device view)
    rows: list[tuple[Any, ...]]


class TraceBrowser:
    def __init__(self, root: str | Path, window: Window | None = None) -> None:
        """`window` (`view --rounds/--time/--request/--worst`): only the rounds, requests and
        rows it overlaps are read (row group by row group, as `export --perfetto`'s window),
        and the leaks view, which needs every memory event of the run, is left out."""
        self.root = Path(root)
        self.trace = Trace.open(self.root)
        self.window = window
        want: dict[str, list[str] | None] = {"steps": None, "probes": None, "timeline": None, "requests": [
            "request_id", "prompt_len", "output_len", "cached_prefix_len", "finish_reason", "arrival_ns",
            "first_token_ns", "finish_ns", "num_preemptions", "dur_itl_ns", "token_runs"]}
        if self.trace.has_table("memory"):  # not in a --no-probes trace
            want["memory"] = None
        if window is None:
            t = read_consistent(self.trace, want)
        else:  # a finished trace's window: each table read on its own, its row groups skipped by their statistics
            t = {name: table_in(self.trace, name, cols or TABLES[name].names, window) for name, cols in want.items()}
        self.steps = t["steps"].take(pc.sort_indices(t["steps"]["ts_ns"]))
        self.probes = t["probes"]
        self.timeline = t["timeline"]
        self.memory = t.get("memory")
        self.requests = t["requests"]
        self.meta = self.trace.meta
        self._step_set = set(self.steps["step"].to_pylist())

    # ---- lists --------------------------------------------------------------------
    def rounds(self) -> Rounds:
        s = self.steps
        pcy = per_cycle(self.probes, s, bounds=None if self.window is None else window_cycles(s, self.window))
        names = sorted(k.split(":", 1)[1] for k in pcy if k.startswith("exposed_ns:"))
        names = [n for n in names if n != B.DEVICE_COMPUTE]
        cols = [*ROUND_COLS, *(f"{n} ms" for n in names)]
        ints = [s[c].to_pylist() for c in ("step", "num_prefill_reqs", "num_prefill_tokens", "num_decode_reqs",
                                            "blocks_used", "num_waiting")]
        ms = np.round(s["dur_ns"].to_numpy() / 1e6, 3).tolist()
        per = [np.round(pcy[f"exposed_ns:{n}"] / 1e6, 3).tolist() for n in names] if pcy else []
        rows = [(st, d, *rest, *costs) for st, d, *rest, costs in
                zip(ints[0], ms, *ints[1:], zip(*per, strict=True) if per else [()] * s.num_rows, strict=True)]
        return Rounds(cols, rows)

    def request_rows(self) -> list[tuple[Any, ...]]:
        q = self.requests
        arr = q["arrival_ns"].to_numpy()
        ft = q["first_token_ns"].to_numpy()
        fin = q["finish_ns"].to_numpy()
        ttft = np.where(ft > 0, np.round((ft - arr) / 1e6, 3), np.nan).tolist()
        e2e = np.round((fin - arr) / 1e6, 3).tolist()
        itl = [round(max(x) / 1e6, 3) if x else 0.0 for x in q["dur_itl_ns"].to_pylist()]
        cols = [q[c].to_pylist() for c in ("request_id", "prompt_len", "output_len", "num_preemptions",
                                             "finish_reason")]
        return [(rid, p, o, None if t != t else t, m, e, n, str(f))  # NaN: no first token
                for rid, p, o, n, f, t, m, e in zip(*cols, ttft, itl, e2e, strict=True)]

    # ---- details --------------------------------------------------------------------
    def round_detail(self, step: int) -> RoundDetail | None:
        got = self.steps.filter(pc.equal(self.steps["step"], step))
        if not got.num_rows:
            return None
        probes = self.probes.filter(pc.equal(self.probes["step"], step))
        probes = probes.filter(pc.not_equal(probes["boundary"].cast(pa.string()), B.IDLE))
        blocks = (self.memory.filter(pc.equal(self.memory["step"], step)).to_pylist()
                  if self.memory is not None else [])
        return RoundDetail(step, got.to_pylist()[0], probes.to_pylist(), self._requests_in(step),
                           [b for b in blocks if not str(b["kind"]).startswith("snapshot")])

    def _requests_in(self, step: int) -> list[str]:
        """Requests that computed in this round: it produced their token (token_runs) or ran
        a prefill chunk of theirs (the timeline's rows for the round)."""
        rids = set()
        for rid, runs in zip(self.requests["request_id"].to_pylist(), self.requests["token_runs"].to_pylist(),
                             strict=True):
            r = np.asarray(runs or [], dtype=np.int64).reshape(-1, 2)
            if len(r) and bool(((r[:, 0] <= step) & (step < r[:, 0] + r[:, 1])).any()):
                rids.add(rid)
        tl = self.timeline.filter(pc.equal(self.timeline["step"], step))
        rids.update(x for x in tl["request_id"].to_pylist() if x)
        return sorted(rids, key=natural_key)

    def request_detail(self, rid: str) -> RequestDetail | None:
        q = self.requests.filter(pc.equal(self.requests["request_id"], rid))
        tl = self.timeline.filter(pc.equal(self.timeline["request_id"], rid))
        if not q.num_rows and not tl.num_rows:
            return None
        tl = tl.take(pc.sort_indices(tl["ts_ns"]))
        stages = [(str(s), int(t), int(st)) for s, t, st in zip(tl["stage"].cast(pa.string()).to_pylist(),
                                                                  tl["ts_ns"].to_pylist(), tl["step"].to_pylist(),
                                                                  strict=True)]
        row = q.to_pylist()[0] if q.num_rows else {}
        rounds = set(st for _, _, st in stages if st >= 0)
        runs = np.asarray(row.get("token_runs") or [], dtype=np.int64).reshape(-1, 2)
        for first, n in runs:
            rounds.update(range(int(first), int(first + n)))
        blocks = (self.memory.filter(pc.equal(self.memory["request_id"], rid)).to_pylist()
                  if self.memory is not None else [])
        rounds &= self._step_set  # a stage stamped outside a round (arrival, queued) names no round
        return RequestDetail(rid, row, stages, sorted(rounds),
                             [b for b in blocks if not str(b["kind"]).startswith("snapshot")])

    # ---- the stalls and leaks views, as the CLI renders them -------------------------
    def stalls_text(self, width: int) -> Text:
        from viewer.analysis.stalls import build_stalls
        from viewer.render.stalls import render_stalls

        res = build_stalls(self.trace, str(self.root))
        return _rendered(width, lambda c: render_stalls(c, res.trace, self.meta, res.stalls))

    def leaks_text(self, width: int) -> Text:
        from viewer.analysis.leaks import leak_report
        from viewer.render.leaks import render_leaks

        if self.memory is None:
            return Text("this trace has no memory table (recorded with --no-probes)")
        if self.window is not None:
            return Text(f"a window ({self.window.what}) holds part of the run's memory events, and a leak is "
                        f"a block the whole run left held: `mstrace leaks {self.root}` reads them all")
        from viewer.analysis.leak_replay import Unordered

        try:
            rep = leak_report(self.memory, self.requests.select(["request_id", "finish_reason"]),
                              int(self.meta.get("model", {}).get("kv_blocks") or 0), run_ended=self.trace.status.complete)
        except Unordered as e:  # a damaged memory table costs this tab, not the whole view
            return Text(f"corrupt memory/ table in {self.root}: {e}")
        return _rendered(width, lambda c: render_leaks(c, str(self.root), rep))


def _rendered(width: int, draw: Any) -> Text:
    buf = io.StringIO()
    draw(Console(file=buf, width=width, force_terminal=True, color_system="truecolor", highlight=False))
    return Text.from_ansi(buf.getvalue())
