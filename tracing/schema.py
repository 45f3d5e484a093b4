"""The trace schema, defined once. docs/trace-schema.md describes every column.

Conventions that let analyses join tables without knowing each one:
every timestamp column ends in `_ns` (CLOCK_MONOTONIC), every duration column is
`dur_*_ns`, and every column naming a scheduling round is `step`.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1

_ids = pa.list_(pa.int32())
_str = pa.dictionary(pa.int32(), pa.string())

REQUESTS = pa.schema([
    ("request_id", pa.string()),
    ("input_ids", _ids),
    ("output_ids", _ids),
    ("output_text", pa.string()),
    ("prompt_len", pa.int32()),
    ("output_len", pa.int32()),
    ("cached_prefix_len", pa.int32()),
    ("finish_reason", pa.string()),
    ("finish_detail", pa.string()),
    ("arrival_ns", pa.int64()),
    ("tokenized_ns", pa.int64()),
    ("queued_ns", pa.int64()),
    ("admitted_ns", pa.int64()),
    ("first_scheduled_ns", pa.int64()),
    ("first_token_ns", pa.int64()),
    ("finish_ns", pa.int64()),
    ("num_preemptions", pa.int32()),
    ("num_prefill_chunks", pa.int32()),
    # gaps between consecutive output tokens (ITL), stored as gaps rather than
    # timestamps: the report pools tens of millions of them and needs no diff
    ("dur_itl_ns", pa.list_(pa.int64())),
    # the rounds whose collect produced this request's tokens, as runs
    # [first_step, count, first_step, count, ...]: with steps.collect_ns they give
    # every ITL gap exactly, from a few numbers per request
    ("token_runs", pa.list_(pa.int64())),
    # when the sender delivered the request's end to the client (its sinks): with a slow
    # client, later than finish_ns by the time its output queued behind others' (0: unknown)
    ("delivered_ns", pa.int64()),
    # why each preemption happened, in order (one per `preempted` timeline event): the
    # policy's own words, naming the request it made room for (`--inject starve`)
    ("preempt_reasons", pa.list_(pa.string())),
])

TIMELINE = pa.schema([
    ("ts_ns", pa.int64()),
    ("request_id", pa.string()),
    ("stage", _str),
    ("step", pa.int64()),
    ("value", pa.int64()),
])

STEPS = pa.schema([
    ("step", pa.int64()),
    ("mode", _str),
    ("ts_ns", pa.int64()),
    ("dur_ns", pa.int64()),
    ("dur_host_ns", pa.int64()),
    ("dur_device_ns", pa.int64()),
    ("num_prefill_reqs", pa.int32()),
    ("num_prefill_tokens", pa.int32()),
    ("num_decode_reqs", pa.int32()),
    ("num_decode_tokens", pa.int32()),
    ("blocks_used", pa.int32()),
    ("blocks_free", pa.int32()),
    ("num_waiting", pa.int32()),
    ("num_running", pa.int32()),
    ("out_queue_depth", pa.int32()),  # StepOutputs the sender has not delivered when this round hands off its own
    ("collect_ns", pa.int64()),  # when this round's sampled tokens were collected (0: none)
    ("blocks_fenced", pa.int32()),  # of blocks_used: freed, but held until the launches reading them finish
])

MEMORY = pa.schema([
    ("ts_ns", pa.int64()),
    ("step", pa.int64()),
    ("kind", _str),
    ("block_id", pa.int32()),
    ("request_id", pa.string()),
    ("ref_count", pa.int32()),
])

PROBES = pa.schema([
    ("ts_ns", pa.int64()),
    ("dur_ns", pa.int64()),
    ("boundary", _str),
    ("stream", _str),
    ("rank", pa.int32()),
    ("step", pa.int64()),
])

# One row per OpenTelemetry span (tracing/otel.py): an `llm_request` root per
# request and a child per lifecycle stage. Times are the trace's monotonic clock
# (converted back from the wall clock OTel spans carry); attributes is JSON.
SPANS = pa.schema([
    ("trace_id", pa.string()),  # 32 hex digits
    ("span_id", pa.string()),  # 16 hex digits
    ("parent_span_id", pa.string()),  # "" for a root span
    ("name", _str),
    ("request_id", pa.string()),
    ("start_ns", pa.int64()),
    ("end_ns", pa.int64()),
    ("dur_ns", pa.int64()),
    ("attributes", pa.string()),  # JSON object of the span's attributes
])

# One row per stalled wait noticed by the watchdog (probes/watchdog.py): the
# wait that passed the watchdog's timeout, the wait cycle if any, and the dump
# (wait-for graph, stream states, thread stacks, KV summary, all active waits) as JSON.
STALLS = pa.schema([
    ("ts_ns", pa.int64()),  # when the watchdog noticed
    ("rank", pa.int32()),
    ("step", pa.int64()),
    ("waiter", pa.string()),
    ("what", pa.string()),
    ("signaller", pa.string()),
    ("boundary", pa.string()),
    ("waited_ns", pa.int64()),
    ("cycle", pa.string()),  # "a -> what -> b -> ... -> a", "" when the graph has no cycle
    ("graph_json", pa.string()),
    ("streams_json", pa.string()),
    ("stacks_json", pa.string()),
    ("kv_json", pa.string()),
    ("waits_json", pa.string()),
])

# One row per tensor-parallel all-reduce of one rank (scheduler/parallel/comm.py's
# CollectiveRecord): NCCL's flight-recorder idea. `seq` numbers the collectives of a
# group identically on every member rank, so rows join across ranks on (group, seq):
# who issued last (the straggler view), who never issued at all (a stall-rank stall).
COLLECTIVES = pa.schema([
    ("rank", pa.int32()),
    ("group", _str),  # "tp<stage>": the TP group of pipeline stage <stage>
    ("seq", pa.int64()),
    ("step", pa.int64()),
    ("numel", pa.int64()),
    ("overlapped", pa.bool_()),  # issued with independent compute behind it
    ("issue_ns", pa.int64()),  # the host enqueued it
    ("start_ns", pa.int64()),  # the transport started (== issue_ns on gloo)
    ("end_ns", pa.int64()),  # completion; -1: still in flight when the rank stopped
    ("dur_wait_ns", pa.int64()),  # the host blocked in wait() (exposed); -1: never waited out
])

# One row per device activity of an imported profiler trace (importers/, `mstrace import`):
# kernels, copies, memsets, and the device side of synchronisations (kind `sync`).
KERNELS = pa.schema([
    ("rank", pa.int32()),
    ("device", pa.int32()),
    ("stream", pa.int64()),  # the profiler's stream id (-1: on no stream)
    ("kind", _str),  # compute, comm, memcpy, memset, other (HTA's classes), sync
    ("name", _str),
    ("ts_ns", pa.int64()),
    ("dur_ns", pa.int64()),
    ("step", pa.int64()),  # the round the launch (or, without one, the start) falls in; -1: none
    ("correlation", pa.int64()),  # the profiler's link to the runtime call that launched it (-1: none)
    ("launch_ns", pa.int64()),  # that call's start (0: no launch in the trace)
    ("dur_launch_ns", pa.int64()),  # that call's own duration
    ("dur_launch_delay_ns", pa.int64()),  # HTA's launch delay: start - the call's end, clipped at 0
])

# One row per wait of an imported trace's scheduling thread on the device (the runtime's
# synchronous calls, a polling loop, a sync-forcing op) and per cudaStreamWaitEvent call.
WAITS = pa.schema([
    ("rank", pa.int32()),
    ("ts_ns", pa.int64()),
    ("dur_ns", pa.int64()),
    ("step", pa.int64()),
    ("what", _str),  # the call or op (cudaStreamSynchronize, aten::item, ...)
    ("caller", _str),  # the innermost operator or annotation open around it ("" at top level)
])

# Columns added since SCHEMA_VERSION 1, by table: a part written before one of them existed
# reads it as this value, so older traces stay readable.
ADDED: dict[str, dict[str, Any]] = {"requests": {"delivered_ns": 0, "preempt_reasons": []},
                                    "steps": {"blocks_fenced": 0}}

TABLES: dict[str, pa.Schema] = {
    "probes": PROBES,
    "requests": REQUESTS,
    "timeline": TIMELINE,
    "steps": STEPS,
    "memory": MEMORY,
    "spans": SPANS,
    "stalls": STALLS,
    "collectives": COLLECTIVES,
    "kernels": KERNELS,
    "waits": WAITS,
}

# Point-in-time columns per table (durations excluded): a rank other than 0 writes them
# already moved onto rank 0's clock (tracing.writer.TraceWriter's clock_offset_ns).
# Values <= 0 are "never happened" markers and are left alone.
TIMESTAMPS: dict[str, tuple[str, ...]] = {
    "probes": ("ts_ns",),
    "requests": ("arrival_ns", "tokenized_ns", "queued_ns", "admitted_ns", "first_scheduled_ns",
                 "first_token_ns", "finish_ns", "delivered_ns"),
    "timeline": ("ts_ns",),
    "steps": ("ts_ns", "collect_ns"),
    "memory": ("ts_ns",),
    "spans": ("start_ns", "end_ns"),
    "stalls": ("ts_ns",),
    "collectives": ("issue_ns", "start_ns", "end_ns"),
    "kernels": ("ts_ns", "launch_ns"),
    "waits": ("ts_ns",),
}

# Columns every row has (when it happened, how long): a null there is a corrupt trace, not a
# marker (the writers never leave one; 0 is "never happened"). The readers check them, so an
# analysis never meets a null where it orders or subtracts.
NEVER_NULL: dict[str, tuple[str, ...]] = {
    "probes": ("ts_ns", "dur_ns"),
    "steps": ("step", "ts_ns", "dur_ns"),
    "requests": ("arrival_ns", "finish_ns"),  # a row is written when its request ends
    "memory": ("ts_ns",),
    "timeline": ("ts_ns",),
}

# The order a flush drains the producers' buffers in. Rows are appended with no lock,
# so a flush sees each buffer at a different moment; the order makes every committed
# flush closed under the references the analyses follow. When a referent row is always
# appended before the rows that refer to it, those rows are drained first (whatever was
# appended before them is still there when its own table is drained); when it is always
# appended after, it is drained first.
#   spans -> requests        the sender writes a request's row, then its spans
#   requests -> steps        the engine appends a round's steps row before the sender gets its tokens
#   requests -> memory, timeline   a request frees its blocks and logs `finished` before its row
#   steps -> timeline, memory, probes   a round's own rows precede its steps row; what they
#                            hold of the next round is clipped by readers of an unfinished trace
DRAIN_ORDER: tuple[str, ...] = ("spans", "requests", "stalls", "collectives", "steps", "timeline", "memory",
                                "probes", "kernels", "waits")
assert set(DRAIN_ORDER) == set(TABLES)
