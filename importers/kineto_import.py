"""`mstrace import`: torch.profiler (Kineto) traces, one file per rank, as an mstrace trace.

The trace written is an ordinary one (the same schema, manifests, meta.json), so every
analysis reads it unchanged:
  * `steps`: one row per round (importers/kineto_host.py), its batch from the round's name
    where a preset knows the engine's annotation;
  * `probes`: the device's activity per device and stream (`device_compute` for compute
    kernels, `device_comm` for communication kernels, `device_copy` for copies and
    memsets: HTA's kernel classes), and the scheduling thread's rows (its waits on the
    device as `scheduler_barrier`, mapped annotations as their boundaries);
  * `kernels`: every device activity with its launch (correlation id, the call's start and
    duration, HTA's launch delay); `waits`: every wait with what it called and its caller.
Nothing is written until every file has been read: a bad file leaves no half-written trace.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from importers.kineto_events import (
    COMM,
    COMPUTE,
    KINDS,
    MEMCPY,
    MEMSET,
    OTHER,
    RUNTIME,
    SYNC,
    RankEvents,
)
from importers.kineto_host import Rounds, find_rounds, host_rows, idle_by_range, scheduling_thread
from importers.kineto_stream import KinetoError, KinetoFile
from probes import boundaries as B
from tracing.run_status import end_record, first_line
from tracing.schema import TABLES
from viewer.analysis.intervals import Coverage, subtract

IDLE_RANGES = 10  # the host ranges the import keeps, by the device idle time charged to each
WHOLE_TRACE = "(whole trace: no range matched the round pattern)"
PROBE_OF_KIND = {COMPUTE: B.DEVICE_COMPUTE, OTHER: B.DEVICE_COMPUTE, COMM: B.DEVICE_COMM, MEMCPY: B.DEVICE_COPY,
                 MEMSET: B.DEVICE_COPY}


@dataclass(frozen=True, slots=True)
class Preset:
    round: str  # the rounds' range names (a regex, searched)
    batch: Callable[[str], tuple[int, int, int, int]] | None = None  # name -> prefill reqs/tokens, decode reqs/tokens
    source: str = ""


def _sglang_batch(name: str) -> tuple[int, int, int, int]:
    m = re.search(r"step\[(\w+)[^\]]*?\bbs=(\d+)(?:[^\]]*?\btoks=(\d+))?", name)
    if m is None:
        return (0, 0, 0, 0)
    mode, bs, toks = m.group(1).upper(), int(m.group(2)), int(m.group(3) or 0)
    if mode in ("EXTEND", "PREFILL"):
        return (bs, toks, 0, 0)
    if mode == "DECODE":
        return (0, 0, bs, bs)
    c, g = re.search(r"\bc=(\d+)", name), re.search(r"\bg=(\d+)", name)  # MIXED with roofline fields
    if c and g:
        return (int(c.group(1)), 0, int(g.group(1)), int(g.group(1)))
    return (0, 0, 0, 0)


def _vllm_batch(name: str) -> tuple[int, int, int, int]:
    def phase(tag: str) -> tuple[int, int]:
        m = re.search(rf"{tag}_(\d+)\((?:sq)?(\d+)", name)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    return (*phase("context"), *phase("generation"))


PRESETS: dict[str, Preset] = {
    "profiler": Preset(r"^ProfilerStep\s*#\s*\d+", None, "torch.profiler's schedule: one range per prof.step()"),
    # vllm/v1/worker/gpu_worker.py Worker.annotate_profile: `execute_<tokens>_context_<reqs>(sq<tokens>...)
    # _generation_<reqs>(sq<tokens>...)` (--profiler-config.detailed_trace_annotation, PR #37524), or
    # `execute_context_<reqs>(<tokens>)_generation_<reqs>(<tokens>)`; before it, `execute_new_<n>_cached_<n>`
    "vllm": Preset(r"^execute_(\d+_)?(context_\d+|new_\d+_cached_\d+)", _vllm_batch,
                   "vllm/v1/worker/gpu_worker.py Worker.annotate_profile"),
    # python/sglang/srt/model_executor/model_runner.py ModelRunner.forward, profile_range(
    # _build_step_span_name(...)): `step[EXTEND bs=<reqs> toks=<tokens>]`, `step[<MODE> bs=<reqs>]` (PR #23419)
    "sglang": Preset(r"^step\[\w+", _sglang_batch, "python/sglang/srt/model_executor/model_runner.py"),
}


@dataclass(slots=True)
class ImportOptions:
    round: str | None = None  # overrides the preset's
    preset: str = "profiler"
    maps: list[tuple[str, str]] = field(default_factory=list)  # (boundary, regex)


@dataclass(slots=True)
class ImportResult:
    out: Path
    ranks: list[int]
    events: int
    rounds: int
    kernels: int
    truncated: list[str]


def profile_files(paths: list[Path]) -> list[Path]:
    """The trace files named, a folder standing for the *.json and *.json.gz files in it."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(x for x in p.iterdir() if x.is_file() and (x.name.endswith(".json")
                                                                     or x.name.endswith(".json.gz")))
            if not found:
                raise KinetoError(f"{p}: no .json or .json.gz files in this folder")
            out += found
        elif p.exists():
            out.append(p)
        else:
            raise KinetoError(f"no such file: {p}")
    return out


def import_kineto(paths: list[Path], out: Path, opts: ImportOptions) -> ImportResult:
    if opts.preset not in PRESETS:
        raise KinetoError(f"unknown preset {opts.preset!r}; presets: {', '.join(PRESETS)}")
    preset = PRESETS[opts.preset]
    try:
        round_re = re.compile(opts.round or preset.round)
        maps = [(b, re.compile(r)) for b, r in opts.maps]
    except re.error as e:
        raise KinetoError(f"bad regular expression: {e}") from None
    for b, _ in opts.maps:
        if b not in B.ALL:
            raise KinetoError(f"--map {b}=...: not a boundary; boundaries: {', '.join(B.ALL)}")
    if out.exists() and any(out.iterdir()):
        raise KinetoError(f"{out} exists and is not empty; choose a new --out")
    files = profile_files(paths)
    ranks: dict[int, tuple[Path, KinetoFile, RankEvents]] = {}
    for i, f in enumerate(files):
        kf, ev = KinetoFile(f), RankEvents()
        try:
            ev.add(kf.events())
        except KinetoError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # an event without its ts, a null dur
            raise KinetoError(f"{f}: a malformed event ({type(e).__name__}: {first_line(e)[:120]})") from None
        if not len(ev.h_ts) and not len(ev.d_ts):
            raise KinetoError(f"{f}: not a Kineto trace: no complete events (X) of a known category")
        dist = kf.meta.get("distributedInfo") or {}
        rank = int(dist.get("rank", i if len(files) > 1 else 0))
        if rank in ranks:
            raise KinetoError(f"{f} and {ranks[rank][0]} both claim rank {rank}")
        ranks[rank] = (f, kf, ev)
    ref = min(ranks)
    base = {r: _base_ns(f, kf) for r, (f, kf, _) in ranks.items()}
    for r, (_, _, ev) in ranks.items():
        ev.offset_ns = base[r] - base[ref]  # every rank on the reference rank's clock
    built = {r: _build(r, kf, ev, round_re, maps, preset) for r, (_, kf, ev) in sorted(ranks.items())}
    _write(out, files, ranks, built, ref, opts, preset, round_re.pattern, base[ref])
    return ImportResult(out, sorted(built), sum(kf.events_read for _, kf, _ in ranks.values()),
                        len(built[ref].rounds.ts), sum(len(b.kernels) for b in built.values()),
                        [f"{p}: {kf.truncated}" for p, kf, _ in ranks.values() if kf.truncated])


@dataclass(slots=True)
class _Built:
    rounds: Rounds
    probes: pa.Table
    kernels: pa.Table
    waits: pa.Table
    busy: tuple[np.ndarray, np.ndarray]  # device activity (not syncs), for each round's device time
    idle: dict[str, Any]  # the device's idle time over the rounds, by the host range open meanwhile


def _build(rank: int, kf: KinetoFile, ev: RankEvents, round_re: re.Pattern[str], maps: list[tuple[str, re.Pattern[str]]],
           preset: Preset) -> _Built:
    h, d, names = ev.host(), ev.device(), ev.names
    round_ids = np.array([i for i, n in enumerate(names.names) if round_re.search(n)], np.int32)
    tid = scheduling_thread(h, round_ids)
    rounds = find_rounds(h, names, round_re, tid)
    if not len(rounds.ts):  # no range repeats: the whole trace is one round, and the report says so
        lo = min(int(h.ts.min()) if len(h.ts) else 2**62, int(d.ts.min()) if len(d.ts) else 2**62)
        hi = max(int(h.end.max()) if len(h.ts) else 0, int((d.ts + d.dur).max()) if len(d.ts) else 0)
        rounds = Rounds(np.array([lo]), np.array([hi]), np.array([0]), [WHOLE_TRACE])
    rows = host_rows(h, names, tid, maps)
    # each device activity's launch: the runtime call with its correlation id
    rt = (h.cat == RUNTIME) & (h.corr >= 0)
    o = np.argsort(h.corr[rt], kind="stable")
    # a sentinel call past every id (it matches none) keeps the lookup total, and sorted
    rc, rts, rend = (np.append(a[rt][o], v) for a, v in ((h.corr, np.iinfo(np.int64).max), (h.ts, 0), (h.end, 0)))
    k = np.minimum(np.searchsorted(rc, d.corr), len(rc) - 1)
    found = (d.corr >= 0) & (rc[k] == d.corr)
    launch = np.where(found, rts[k], 0)
    launch_dur = np.where(found, rend[k] - rts[k], 0)
    delay = np.where(found, np.maximum(d.ts - (launch + launch_dur), 0), 0)
    step = rounds.step_of(np.where(found, launch, d.ts))
    kind_names = np.array(KINDS, dtype=object)
    kernels = pa.table({
        "rank": pa.array(np.full(len(d.ts), rank, np.int32)), "device": pa.array(d.dev),
        "stream": pa.array(d.stream.astype(np.int64)),
        "kind": pa.DictionaryArray.from_arrays(pa.array(d.kind.astype(np.int32)), pa.array(list(KINDS))),
        "name": pa.DictionaryArray.from_arrays(pa.array(d.name), pa.array(names.names)),
        "ts_ns": pa.array(d.ts), "dur_ns": pa.array(d.dur), "step": pa.array(step.astype(np.int64)),
        "correlation": pa.array(d.corr), "launch_ns": pa.array(launch.astype(np.int64)),
        "dur_launch_ns": pa.array(launch_dur.astype(np.int64)), "dur_launch_delay_ns": pa.array(delay.astype(np.int64)),
    })
    # Device rows. Compute as it is (the views merge it); communication, then copies, merged
    # and cut where a row of the class before has the instant: the device view charges a
    # non-compute instant once (HTA's non-compute time: all activity minus compute).
    dev = d.kind != KINDS.index(SYNC)
    kind_of = kind_names[d.kind]
    comp = dev & np.isin(kind_of, [COMPUTE, OTHER])
    comm = _merged(d.ts[kind_of == COMM], (d.ts + d.dur)[kind_of == COMM])
    cp = np.isin(kind_of, [MEMCPY, MEMSET])
    copy = _merged(*subtract(d.ts[cp], (d.ts + d.dur)[cp], *comm)) if len(comm[0]) else \
        _merged(d.ts[cp], (d.ts + d.dur)[cp])
    parts = [(d.ts[comp], d.dur[comp], B.DEVICE_COMPUTE,
              [f"gpu{a}.s{b}" for a, b in zip(d.dev[comp].tolist(), d.stream[comp].tolist(), strict=True)]),
             (comm[0], comm[1] - comm[0], B.DEVICE_COMM, None), (copy[0], copy[1] - copy[0], B.DEVICE_COPY, None),
             (np.array(rows.ts, np.int64), np.array(rows.dur, np.int64), None, None)]
    p_ts = np.concatenate([p[0] for p in parts])
    labels: list[str] = []
    streams: list[str] = []
    for ts_, _, b, st in parts[:3]:
        labels += [b] * len(ts_)  # type: ignore[list-item]
        streams += st if st is not None else [f"gpu.{b}"] * len(ts_)
    labels += rows.boundary
    streams += ["host"] * len(rows.ts)
    probes = pa.table({
        "ts_ns": pa.array(p_ts), "dur_ns": pa.array(np.concatenate([p[1] for p in parts])),
        "boundary": pa.array(labels, pa.string()).dictionary_encode(),
        "stream": pa.array(streams, pa.string()).dictionary_encode(),
        "rank": pa.array(np.full(len(p_ts), rank, np.int32)),
        "step": pa.array(rounds.step_of(p_ts).astype(np.int64)),
    }).sort_by("ts_ns")
    w = rows.waits
    wts = np.array([x[0] for x in w], np.int64)
    waits = pa.table({
        "rank": pa.array(np.full(len(w), rank, np.int32)), "ts_ns": pa.array(wts),
        "dur_ns": pa.array(np.array([x[1] for x in w], np.int64)), "step": pa.array(rounds.step_of(wts)),
        "what": pa.array([x[2] for x in w], pa.string()).dictionary_encode(),
        "caller": pa.array([x[3] for x in w], pa.string()).dictionary_encode(),
    })
    lo, hi = int(rounds.ts[0]), int(rounds.end[-1])
    by, uncovered = idle_by_range(h, names, tid, d.ts[dev], d.ts[dev] + d.dur[dev], lo, hi)
    top = sorted(by.items(), key=lambda x: -x[1])[:IDLE_RANGES]
    idle = {"span_ns": hi - lo, "idle_ns": sum(by.values()) + uncovered, "no_range_ns": uncovered,
            "ranges": [{"range": n, "idle_ns": v} for n, v in top], "other_ranges_ns": sum(by.values()) -
            sum(v for _, v in top)}
    return _Built(rounds, probes, kernels, waits, (d.ts[dev], d.ts[dev] + d.dur[dev]), idle)


def _merged(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = Coverage(s, e)
    return c.s, c.e


def _steps(b: _Built, preset: Preset, mode: str) -> pa.Table:
    r = b.rounds
    n = len(r.ts)
    cov = Coverage(*b.busy) if len(b.busy[0]) else None
    dev = cov.covered(r.ts, r.end) if cov is not None else np.zeros(n, np.int64)
    batch = np.array([preset.batch(x) if preset.batch else (0, 0, 0, 0) for x in r.label], np.int32).reshape(n, 4)
    zero = np.zeros(n, np.int32)
    dur = r.end - r.ts
    return pa.table({
        "step": pa.array(r.step), "mode": pa.array([mode] * n).dictionary_encode(), "ts_ns": pa.array(r.ts),
        "dur_ns": pa.array(dur), "dur_host_ns": pa.array(np.maximum(dur - dev, 0).astype(np.int64)),
        "dur_device_ns": pa.array(np.asarray(dev, np.int64)),
        "num_prefill_reqs": pa.array(batch[:, 0]), "num_prefill_tokens": pa.array(batch[:, 1]),
        "num_decode_reqs": pa.array(batch[:, 2]), "num_decode_tokens": pa.array(batch[:, 3]),
        "blocks_used": pa.array(zero), "blocks_free": pa.array(zero), "num_waiting": pa.array(zero),
        "num_running": pa.array(zero), "out_queue_depth": pa.array(zero),
        "collect_ns": pa.array(np.zeros(n, np.int64)), "blocks_fenced": pa.array(zero),
    })


def _write(out: Path, files: list[Path], ranks: dict[int, tuple[Path, KinetoFile, RankEvents]],
           built: dict[int, _Built], ref: int, opts: ImportOptions, preset: Preset, round_pattern: str,
           base_ns: int) -> None:
    from tracing.writer import TraceWriter

    tmp = out.with_name(out.name + ".importing")
    shutil.rmtree(tmp, ignore_errors=True)
    w = TraceWriter(tmp, flush_interval_s=3600)
    try:
        src = {str(r): {**_source(p, kf), "device_idle": built[r].idle} for r, (p, kf, _) in sorted(ranks.items())}
        truncated = [f"{p.name}: {kf.truncated}" for p, kf, _ in ranks.values() if kf.truncated]
        meta: dict[str, Any] = {
            "config": {"mode": "imported"},
            "model": {"name": None},
            "workload": {"source": "kineto", "requests": 0},
            "import": {"format": "kineto", "files": [str(f) for f in files], "preset": opts.preset,
                       "preset_source": preset.source, "round": round_pattern,
                       "maps": {b: r for b, r in opts.maps}, "reference_rank": ref, "ranks": src},
            "ranks": {str(r): {"offset_ns": 0} for r in built},
        }
        if base_ns:  # the trace's times are the reference rank's ts: on the wall clock, its base later
            meta["clock"] = {"name": "kineto", "anchor_monotonic_ns": 0, "anchor_unix_ns": base_ns}
        w.write_meta(meta)
        tables = {"steps": _steps(built[ref], preset, "imported"),
                  "probes": pa.concat_tables([b.probes for b in built.values()]).combine_chunks(),
                  "kernels": pa.concat_tables([b.kernels for b in built.values()]).combine_chunks(),
                  "waits": pa.concat_tables([b.waits for b in built.values()]).combine_chunks()}
        w.commit_tables({k: _unify(v, TABLES[k]) for k, v in tables.items()})
        r = built[ref].rounds
        state, detail = ("truncated", "; ".join(truncated)) if truncated else ("complete", "")
        meta["run"] = end_record(state, detail, 0, int(r.ts[0]), int(r.end[-1]), len(r.ts))
    except BaseException:
        w.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    w.close(meta)
    if out.exists():  # an empty folder the user made for it
        out.rmdir()
    tmp.rename(out)


def _unify(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """Dictionary columns with one dictionary (ranks' tables concatenated), in schema order."""
    t = t.unify_dictionaries().combine_chunks()
    return pa.table({f.name: t[f.name].cast(f.type) for f in schema}, schema=schema)


def _base_ns(path: Path, kf: KinetoFile) -> int:
    """The file's baseTimeNanoseconds (Kineto since 2023: its `ts` are relative to it), or 0
    (older files' `ts` are the wall clock's own)."""
    v = kf.meta.get("baseTimeNanoseconds", 0)
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        raise KinetoError(f"{path}: baseTimeNanoseconds {v!r} is not a number of ns") from None


def _source(path: Path, kf: KinetoFile) -> dict[str, Any]:
    m = kf.meta
    devices = [d.get("name") for d in m.get("deviceProperties") or [] if isinstance(d, dict)]
    dist = m.get("distributedInfo") or {}
    runtime = {k: m[k] for k in ("cupti_version", "cuda_runtime_version", "roctracer_version", "hip_runtime_version")
               if k in m}
    return {"file": str(path), "schema_version": m.get("schemaVersion"), "trace_name": m.get("traceName"),
            "base_time_ns": m.get("baseTimeNanoseconds"),
            "devices": devices, "world_size": dist.get("world_size"), "backend": dist.get("backend"),
            "runtime": runtime, "events": kf.events_read, "truncated": kf.truncated}
