"""One rank's Kineto events sorted into what an mstrace trace is made of.

One pass over the event stream keeps, in flat arrays, only what the import needs:
  * host ranges (`cpu_op`, `user_annotation`, `cuda_runtime`, `cuda_driver`) by thread;
  * device activity (`kernel`, `gpu_memcpy`, `gpu_memset`, and `cuda_sync` for HTA's sums),
    each with its correlation id;
  * the runtime call behind each correlation id (the launch).
Python-function ranges (`with_stack`) are skipped: they are most of a stack trace's events
and no view reads them. Names are interned once: a million `aten::mm` rows hold one string.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# HTA's kernel classes (hta/common/types.py, v0.5): the same names classify alike here.
COMM_KERNEL = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
MEMORY_KERNEL = re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)")
NOT_COMPUTE = re.compile(r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)"
                         r"|(^runFunction)|(^hip)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)"
                         r"|(^collective_subgraph_execution)")
# kinds of device activity (kernels.kind)
COMPUTE, COMM, MEMCPY, MEMSET, OTHER, SYNC = "compute", "comm", "memcpy", "memset", "other", "sync"
KINDS = (COMPUTE, COMM, MEMCPY, MEMSET, OTHER, SYNC)

HOST_CATS = {"cpu_op": 0, "user_annotation": 1, "cuda_runtime": 2, "cuda_driver": 2}
CPU_OP, ANNOTATION, RUNTIME = 0, 1, 2
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_sync")


def kernel_kind(name: str, cat: str) -> str:
    """HTA's get_kernel_type, with memory split into memcpy and memset (cuda_sync: SYNC)."""
    if cat == "cuda_sync":
        return SYNC
    if COMM_KERNEL.match(name):
        return COMM
    if MEMORY_KERNEL.match(name) or cat in ("gpu_memcpy", "gpu_memset"):
        return MEMSET if "Memset" in name or cat == "gpu_memset" else MEMCPY
    return OTHER if NOT_COMPUTE.match(name) else COMPUTE


@dataclass(slots=True)
class Names:
    """Interned strings: id -> name, and the kind of each kernel name."""

    ids: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)

    def id(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            self.names.append(name)
        return i


@dataclass(slots=True)
class RankEvents:
    """One file's events in flat arrays (times in ns, relative to nothing: Kineto's clock)."""

    names: Names = field(default_factory=Names)
    # host ranges
    h_tid: array[int] = field(default_factory=lambda: array("q"))
    h_ts: array[int] = field(default_factory=lambda: array("q"))
    h_end: array[int] = field(default_factory=lambda: array("q"))
    h_name: array[int] = field(default_factory=lambda: array("i"))
    h_cat: array[int] = field(default_factory=lambda: array("b"))
    h_corr: array[int] = field(default_factory=lambda: array("q"))
    # device activity
    d_ts: array[int] = field(default_factory=lambda: array("q"))
    d_dur: array[int] = field(default_factory=lambda: array("q"))
    d_dev: array[int] = field(default_factory=lambda: array("i"))
    d_stream: array[int] = field(default_factory=lambda: array("q"))
    d_kind: array[int] = field(default_factory=lambda: array("b"))
    d_name: array[int] = field(default_factory=lambda: array("i"))
    d_corr: array[int] = field(default_factory=lambda: array("q"))
    tids: dict[Any, int] = field(default_factory=dict)  # Kineto's (pid, tid) -> a small int
    skipped: int = 0  # events of no category read here (python functions, instants, flows, metadata)
    # added to every time as the arrays are handed out: this file's baseTimeNanoseconds less the
    # reference rank's (Kineto writes each `ts` relative to its process's base; the bases of
    # two ranks differ when they started on either side of a trimester's turn)
    offset_ns: int = 0

    def add(self, events: Iterable[dict[str, Any]]) -> None:
        kinds: dict[int, int] = {}
        host_cats, tids, names = HOST_CATS, self.tids, self.names
        for ev in events:
            cat = ev.get("cat")
            if ev.get("ph") != "X" or cat is None:
                self.skipped += 1
                continue
            hc = host_cats.get(cat)
            if hc is not None:
                ts = round(ev["ts"] * 1000)
                key = (ev.get("pid"), ev.get("tid"))
                t = tids.get(key)
                if t is None:
                    t = tids[key] = len(tids)
                args = ev.get("args") or {}
                self.h_tid.append(t)
                self.h_ts.append(ts)
                self.h_end.append(ts + round(ev.get("dur", 0) * 1000))
                self.h_name.append(names.id(ev.get("name", "")))
                self.h_cat.append(hc)
                self.h_corr.append(int(args.get("correlation", -1)))
            elif cat in DEVICE_CATS:
                args = ev.get("args") or {}
                name = ev.get("name", "")
                nid = names.id(name)
                kind = kinds.get(nid) if cat != "cuda_sync" else KINDS.index(SYNC)
                if kind is None:
                    kind = kinds[nid] = KINDS.index(kernel_kind(name, cat))
                ts = round(ev["ts"] * 1000)
                self.d_ts.append(ts)
                self.d_dur.append(round(ev.get("dur", 0) * 1000))
                self.d_dev.append(int(args.get("device", ev.get("pid", 0)) or 0))
                stream = args.get("stream")
                self.d_stream.append(-1 if stream is None else int(stream))  # HTA's -1: on no stream
                self.d_kind.append(kind)
                self.d_name.append(nid)
                self.d_corr.append(int(args.get("correlation", -1)))
            else:
                self.skipped += 1

    def host(self) -> HostArrays:
        h = HostArrays(*(_np(a) for a in (self.h_tid, self.h_ts, self.h_end, self.h_name, self.h_cat, self.h_corr)))
        if self.offset_ns:
            h.ts, h.end = h.ts + self.offset_ns, h.end + self.offset_ns
        return h

    def device(self) -> DeviceArrays:
        d = DeviceArrays(*(_np(a) for a in (self.d_ts, self.d_dur, self.d_dev, self.d_stream, self.d_kind,
                                            self.d_name, self.d_corr)))
        if self.offset_ns:
            d.ts = d.ts + self.offset_ns
        return d


def _np(a: array[int]) -> np.ndarray:
    return np.frombuffer(a, dtype=a.typecode) if len(a) else np.zeros(0, a.typecode)


@dataclass(slots=True)
class HostArrays:
    tid: np.ndarray
    ts: np.ndarray
    end: np.ndarray
    name: np.ndarray
    cat: np.ndarray
    corr: np.ndarray


@dataclass(slots=True)
class DeviceArrays:
    ts: np.ndarray
    dur: np.ndarray
    dev: np.ndarray
    stream: np.ndarray
    kind: np.ndarray
    name: np.ndarray
    corr: np.ndarray
