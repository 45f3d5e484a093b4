"""Engine configuration: one record, validated once, recorded in meta.json."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

MODES = ("serial", "timeslice", "overlap")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message is one line for the user."""


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"  # preset name or a local HF folder
    mode: str = "serial"
    block_size: int = 16
    kv_blocks: int | None = None  # pool size in blocks ...
    kv_bytes: int | None = None  # ... or in bytes; default: DEFAULT_KV_TOKENS tokens
    prefill_chunk: int = 512
    timeslice_chunk: int = 256  # time-slice mode: one prefill chunk of this size per cycle
    # Overlap sub-features, switchable separately; None = on exactly in overlap mode.
    overlap_schedule: bool | None = None  # (a) schedule/prepare round N+1 while the device runs N
    split_streams: bool | None = None  # (b) decode on `main`, prefill on `prefill`, joined by events
    prefill_stagger_us: float = 0.0  # (c) prefill work starts this long after decode work
    decode_max_wait_ms: float = 500.0  # a decode that waited this long gets a decode-only round
    prefill_max_wait_ms: float = 2000.0  # a prefill that waited this long for blocks evicts decodes
    max_running: int = 256
    # Blocks kept back at admission so running decodes can still grow.
    watermark_frac: float = 0.01
    enable_prefix_sharing: bool = True
    # paged: a request's blocks are scattered (block table). contiguous: one run of
    # consecutive blocks reserved for its whole life (fragments; see defrag).
    kv_layout: str = "paged"
    defrag_free_frac: float = 0.3  # defragment when free > this share of the pool but no run fits
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # Intra-op threads for the "device" on CPU. 0 = cores - 1, so the host
    # thread (scheduling, tokenizer, sender, trace writer) keeps a core: with
    # every core given to OpenMP, any other runnable thread makes its barrier
    # spin and a step can get ~100x slower (measured on 2 cores, BENCHMARKS.md).
    device_threads: int = 0
    # thread: the CPU device's streams are threads of this process (they share its GIL with
    # the scheduler). process: the device is a process of its own (scheduler/device_process.py),
    # so host work overlaps device work as it does on a GPU.
    cpu_device: str = "thread"
    tokenizer_threads: int = 1
    seed: int = 0
    probes: bool = True  # False: no probes/memory tables (requests, timeline, steps stay)
    wait_timeout_s: float = 5.0  # every timed wait in the engine (the seed's 5 s)
    snapshot_every: int = 50  # full block-table snapshot every N rounds; 0 = never
    # Test-only (the truth harness, scheduler/debug_delay.py): (place, ms) delays that a
    # test checks the cost table charges to the right row.
    debug_delay_ms: tuple[tuple[str, float], ...] = ()
    inject: tuple[str, ...] = ()  # fault injection, see scheduler/faults.py
    gc: bool = True  # the periodic GC scan that reclaims leaked / stuck blocks
    gc_after_s: float = 10.0
    on_stall: str = "abort"  # abort | continue, when a wait passes wait_timeout_s
    # Test-only: verify on the device stream that no KV slot is read before its write,
    # and (negative control) drop the cross-stream event waits that guarantee it.
    debug_kv_check: bool = False
    debug_skip_stream_waits: bool = False
    # Tensor x pipeline parallel (scheduler/parallel/): this process is rank 0 and spawns the
    # other tp * pp - 1 ranks. comm_overlap: hide each all-reduce behind the other half of the
    # batch (scheduler/parallel/tp.py).
    tp: int = 1
    pp: int = 1
    comm_overlap: bool = True
    # pp > 1: cut each round's batch at a sequence boundary into this many parts (1 or 2), so
    # the next stage computes the first while this stage computes the second.
    pp_microbatches: int = 2

    def validate(self) -> None:
        for f in fields(self):  # a NaN passes every `< 0` check below: refuse it first
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                flag = {"wait_timeout_s": "wait-timeout"}.get(f.name, f.name.replace("_", "-"))
                raise ConfigError(f"--{flag} must be a finite number, got {v}")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.timeslice_chunk < 1:
            raise ConfigError(f"--timeslice-chunk must be >= 1 (got {self.timeslice_chunk})")
        for name in ("prefill_stagger_us", "decode_max_wait_ms", "prefill_max_wait_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        if self.block_size < 1:
            raise ConfigError(f"--block-size must be >= 1 (got {self.block_size})")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError(f"--kv-blocks must be >= 1 (got {self.kv_blocks})")
        if self.kv_bytes is not None and self.kv_bytes < 1:
            raise ConfigError(f"--kv-bytes must be >= 1 (got {self.kv_bytes})")
        if self.kv_blocks is not None and self.kv_bytes is not None:
            raise ConfigError("give the KV pool size in blocks or in bytes, not both")
        if self.prefill_chunk < 1:
            raise ConfigError(f"--prefill-chunk must be >= 1 (got {self.prefill_chunk})")
        if self.max_running < 1:
            raise ConfigError(f"--max-running must be >= 1 (got {self.max_running})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda (got {self.device!r})")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        if self.wait_timeout_s <= 0:
            raise ConfigError(f"--wait-timeout must be > 0 (got {self.wait_timeout_s})")
        if self.snapshot_every < 0:
            raise ConfigError(f"--snapshot-every must be >= 0 (got {self.snapshot_every})")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ConfigError(f"--kv-layout must be paged or contiguous (got {self.kv_layout!r})")
        if self.on_stall not in ("abort", "continue"):
            raise ConfigError(f"--on-stall must be abort or continue (got {self.on_stall!r})")
        if self.gc_after_s < 0:
            raise ConfigError(f"--gc-after-s must be >= 0 (got {self.gc_after_s})")
        from scheduler.debug_delay import PLACES
        from scheduler.faults import parse_faults

        bad = [p for p, ms in self.debug_delay_ms if p not in PLACES or ms < 0]
        if bad:
            raise ConfigError(f"--debug-delay-ms: unknown place or negative delay at {bad[0]!r}; "
                              f"places: {', '.join(PLACES)}")

        try:
            parse_faults(self.inject)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if "deadlock" in self.inject and not self.split_on:
            raise ConfigError("--inject deadlock needs split streams: use --mode overlap")
        if self.cpu_device not in ("thread", "process"):
            raise ConfigError(f"--cpu-device must be auto, thread or process (got {self.cpu_device!r})")
        if self.cpu_device == "process":
            # These hand the device Python callables or host objects, which cannot cross a process.
            clash = self._needs_in_process_device()
            if clash:
                raise ConfigError(f"--cpu-device process does not support {', '.join(clash)}; "
                                  "use --cpu-device thread")
        if self.tokenizer_threads < 1:
            raise ConfigError("--tokenizer-threads must be >= 1")
        if self.tp < 1 or self.pp < 1:
            raise ConfigError(f"--tp and --pp must be >= 1 (got {self.tp}, {self.pp})")
        if self.world_size > 1 and (self.overlap_on or self.split_on):
            # A placeholder token lives in rank 0's future ring only; the other ranks would
            # need the ring too (and split streams would interleave two forwards' collectives).
            raise ConfigError("--tp/--pp > 1 runs rounds serially: use --no-overlap-schedule "
                              "--no-split-streams (mstrace run sets both)")
        if self.pp_microbatches not in (1, 2):
            raise ConfigError(f"--pp-microbatches must be 1 or 2 (got {self.pp_microbatches})")
        if "stall-rank" in self.inject and self.world_size < 2:
            raise ConfigError("--inject stall-rank needs more than one rank (--tp or --pp > 1)")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def hard_wait_timeout_s(self) -> float:
        """When a wait itself gives up: after the watchdog has had time to report it
        (abort), or much later (continue: a slow wait is reported but allowed to finish)."""
        return self.wait_timeout_s + 0.5 if self.on_stall == "abort" else 10 * self.wait_timeout_s

    @property
    def overlap_on(self) -> bool:
        return self.mode == "overlap" if self.overlap_schedule is None else self.overlap_schedule

    @property
    def split_on(self) -> bool:
        return self.mode == "overlap" if self.split_streams is None else self.split_streams

    def pick_cpu_device(self) -> str:
        """What `--cpu-device auto` means for this run: a device process, unless a feature
        needs the device in this process (see validate)."""
        return "thread" if self._needs_in_process_device() else "process"

    def _needs_in_process_device(self) -> list[str]:
        """Features that hand the device Python objects, which cannot cross a process."""
        return [flag for flag, on in (("--tp/--pp > 1", self.world_size > 1),
                                      ("the KV ordering check", self.debug_kv_check)) if on]

    def resolved_device_threads(self) -> int:
        return self.device_threads if self.device_threads > 0 else max(1, (os.cpu_count() or 1) - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_KV_TOKENS = 65536


def parse_size(text: str) -> int:
    """'512MiB', '2G', '1048576' -> bytes."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in units or not num:
        raise ConfigError(f"cannot read size {text!r} (examples: 268435456, 256MiB, 1G)")
    try:
        return int(float(num) * units[unit])
    except ValueError as e:
        raise ConfigError(f"cannot read size {text!r}") from e
