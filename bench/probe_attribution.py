"""Attribute a run's tracing cost from its own trace: rows by kind x per-row cost, plus
the writer's own CPU time, as a share of the run's CPU time (bench/bench_probe_cpu.py).

Two scopes, because `--no-probes` does not switch everything off:
  * probes: what --no-probes removes: the probes and memory tables (rows on the hot path
    and the writer's work on those two tables). The writer's work on no table in
    particular (waking up, manifest commits) is charged here too, although it stays
    with --no-probes: an upper bound.
  * trace: everything tracing costs: the above plus the timeline, steps, requests and
    spans rows, the token-runs stamps and all of the writer's CPU time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from probes import boundaries as b
from tracing.reader import Trace
from tracing.schema import TABLES

PROBE_TABLES = ("probes", "memory")  # what --no-probes removes

# boundary -> the emission site's kind (bench/bench_probe_cost.py measures each)
_HOST_KIND = {
    b.BOOKKEEPING: "probe.step", b.BATCH_PREPARE: "probe.step", b.RESPONSE_SEND: "probe.step",
    b.DEFRAG: "probe.step",
    b.SCHEDULER_BARRIER: "probe.wait", b.IDLE: "probe.wait", b.PREFILL_STAGGER: "probe.wait",
    b.ALL_REDUCE: "probe.wait", b.PP_BUBBLE: "probe.wait", b.BATCH_BROADCAST: "probe.wait",
    b.KV_FENCE: "probe.attr", b.TOKENIZE: "probe.attr", b.RESPONSE_DELIVER: "probe.attr",
}
_HOST_STREAMS = ("host", "tokenizer", "sender")
UNKNOWN = "probe.unknown"  # a boundary this map does not know: priced as the dearest probe kind


@dataclass(slots=True)
class TraceRows:
    by_kind: dict[str, int]  # emission kind -> rows
    by_table: dict[str, int]  # table -> rows on disk
    output_tokens: int
    prompt_len: float  # means, for the micro-benchmark of requests and spans rows
    output_len: float


def trace_rows(root: Path) -> TraceRows:
    """Count every row of a trace by the kind of site that emitted it."""
    tr = Trace.open(root)
    kinds: dict[str, int] = {}

    def add(kind: str, n: int) -> None:
        if n:
            kinds[kind] = kinds.get(kind, 0) + n

    probes = tr.table("probes", ["boundary", "stream"])
    for row in probes.group_by(["boundary", "stream"]).aggregate([("boundary", "count")]).to_pylist():
        kind = "probe.device" if row["stream"] not in _HOST_STREAMS else _HOST_KIND.get(row["boundary"], UNKNOWN)
        add(kind, row["boundary_count"])
    memory = tr.table("memory", ["kind"])
    for row in memory.group_by(["kind"]).aggregate([("kind", "count")]).to_pylist():
        add("memory.snapshot" if row["kind"] in ("snapshot", "snapshot_begin") else "memory.event", row["kind_count"])
    requests = tr.table("requests", ["prompt_len", "output_len"])
    tokens = int(pc.sum(requests["output_len"]).as_py() or 0)
    by_table = {"probes": probes.num_rows, "memory": memory.num_rows, "requests": requests.num_rows}
    for name in ("timeline", "steps", "spans", "stalls", "collectives"):
        by_table[name] = tr.table(name, [TABLES[name].names[0]]).num_rows
    for name in ("timeline", "steps", "requests", "spans"):
        add(name, by_table[name])
    add("token_runs", tokens)
    n = max(1, requests.num_rows)
    return TraceRows(kinds, by_table, tokens, float(pc.sum(requests["prompt_len"]).as_py() or 0) / n, tokens / n)


@dataclass(slots=True)
class Attribution:
    rows: dict[str, int]
    hot_ns: dict[str, float]  # rows x per-row cost, by kind
    writer_ns: int  # all of the writer's CPU time (run.writer.cpu_ns)
    writer_probes_ns: int  # its probes + memory tables, plus its work on no table (upper bound)
    run_cpu_ns: int  # the run's CPU time: this process and the CPU device process (run.cpu.total_ns)
    output_tokens: int
    probes_ns: float
    trace_ns: float

    @property
    def probes_share(self) -> float:
        return self.probes_ns / self.run_cpu_ns

    @property
    def trace_share(self) -> float:
        return self.trace_ns / self.run_cpu_ns

    def per_token_us(self, ns: float) -> float:
        return ns / max(1, self.output_tokens) / 1e3


def attribute(meta: dict[str, Any], rows: TraceRows, cost_ns: dict[str, float], scope: dict[str, str]) -> Attribution:
    """`cost_ns`: per-row cost by kind; `scope`: kind -> "probes" | "trace"."""
    run = meta["run"]
    w = run["writer"]
    probe_costs = [c for k, c in cost_ns.items() if scope.get(k) == "probes" and k.startswith("probe.")]
    costs = {**cost_ns, UNKNOWN: max(probe_costs, default=0.0)}
    hot = {k: n * max(0.0, costs[k]) for k, n in rows.by_kind.items()}
    tables = w["table_cpu_ns"]
    unshared = w["cpu_ns"] - sum(tables.values())  # loop wake-ups, manifest commits, the thread itself
    writer_probes = sum(tables.get(t, 0) for t in PROBE_TABLES) + max(0, unshared)
    probes = sum(v for k, v in hot.items() if scope.get(k, "probes") == "probes") + writer_probes
    trace = sum(hot.values()) + w["cpu_ns"]
    return Attribution(rows.by_kind, hot, w["cpu_ns"], writer_probes, run["cpu"]["total_ns"], rows.output_tokens,
                       probes, trace)
