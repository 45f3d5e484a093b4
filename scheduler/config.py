"""Engine configuration: one record, validated once, recorded in meta.json.

Each field declares its own choices and bounds (`option(...)`, scheduler/options.py);
`cross_field_problems` holds the few rules between fields. What `mstrace run` and
`serve` add lives in scheduler/harness/run_options.py and scheduler/serving/options.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from scheduler.options import (
    DEVICE,
    FAULTS,
    MEMORY,
    OUTPUT,
    PARALLEL,
    SCHEDULING,
    WORKLOAD,
    ConfigError,
    check_fields,
    option,
)

MODES = ("serial", "timeslice", "overlap")
DEFAULT_KV_TOKENS = 65536


def _size(v: Any) -> int | None:
    """--kv-bytes: a size with units ("256MiB") or, in a TOML file, a plain integer."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise ConfigError(f"--kv-bytes must be a size such as 256MiB, got {v!r}")
    return v if isinstance(v, int) else parse_size(v)


def _on_off(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if v not in ("on", "off"):
        raise ConfigError(f"--comm-overlap must be on or off, got {v!r}")
    return str(v) == "on"


def _delays(v: Any) -> tuple[tuple[str, float], ...]:
    from scheduler.harness.debug_delay import parse

    if not isinstance(v, list | tuple | type(None)) or not all(isinstance(x, str) for x in v or ()):
        raise ConfigError(f"--debug-delay-ms takes PLACE=MS strings, got {v!r}")
    try:
        return parse(list(v or ()))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _known_delays(v: tuple[tuple[str, float], ...]) -> None:
    from scheduler.harness.debug_delay import PLACES

    bad = [(p, ms) for p, ms in v if p not in PLACES or not 0 <= ms < float("inf")]
    if bad:
        raise ConfigError(f"--debug-delay-ms: unknown place or negative delay at {bad[0]!r}; "
                          f"places: {', '.join(PLACES)}")


def _known_faults(v: tuple[str, ...]) -> None:
    from scheduler.harness.faults import parse_faults

    parse_faults(v)


@dataclass(slots=True)
class EngineConfig:
    model: str = option("default", "Preset name (tiny, small, default) or a local HF Llama-family folder.", DEVICE)
    mode: str = option("serial", "serial, timeslice, overlap, or all (mstrace run: the three, one after another).",
                       SCHEDULING, choices=MODES)
    block_size: int = option(16, "Tokens per KV block.", MEMORY, ge=1)
    kv_blocks: int | None = option(None, f"KV pool size in blocks (default: {DEFAULT_KV_TOKENS} tokens' worth, or "
                                   "--kv-bytes).", MEMORY, ge=1)
    kv_bytes: int | None = option(None, "KV pool size in bytes (e.g. 256MiB).", MEMORY, cli_type=str | None,
                                  parse=_size, ge=1, le=2**50)
    prefill_chunk: int = option(512, "Max prefill tokens per round (chunked prefill).", SCHEDULING, ge=1)
    timeslice_chunk: int = option(256, "timeslice mode: one prefill chunk of this many tokens per cycle.", SCHEDULING,
                                  ge=1)
    # Overlap sub-features, switchable separately; None = on exactly in overlap mode.
    overlap_schedule: bool | None = option(
        None, "(a) prepare round N+1 while the device runs N (default: on in overlap mode).", SCHEDULING)
    split_streams: bool | None = option(
        None, "(b) decode on main, prefill on its own stream, joined by events (default: on in overlap mode).",
        SCHEDULING)
    prefill_stagger_us: float = option(0.0, "(c) start prefill work this many us after decode work.", SCHEDULING,
                                       ge=0)
    decode_max_wait_ms: float = option(500.0, "A decode that waited this long gets a decode-only round.", SCHEDULING,
                                       ge=0)
    prefill_max_wait_ms: float = option(2000.0, "A prefill that waited this long for blocks evicts decodes.",
                                        SCHEDULING, ge=0)
    max_running: int = option(256, "Max requests in the running queue.", SCHEDULING, ge=1)
    watermark_frac: float = option(0.01, "Share of the KV pool kept back at admission so running decodes can grow.",
                                   MEMORY, ge=0, lt=1)
    enable_prefix_sharing: bool = option(True, "Share KV blocks of common prompt prefixes.", MEMORY,
                                         flag="prefix-sharing")
    # paged: a request's blocks are scattered (block table). contiguous: one run of
    # consecutive blocks reserved for its whole life (fragments; see defrag).
    kv_layout: str = option("paged", "paged (scattered blocks) or contiguous (one run per request; fragments, "
                            "defragments).", MEMORY, choices=("paged", "contiguous"))
    defrag_free_frac: float = option(0.3, "contiguous: defragment when this share of the pool is free but no run "
                                     "fits.", MEMORY, ge=0, le=1)
    device: str = option("auto", "auto, cpu or cuda.", DEVICE, choices=("auto", "cpu", "cuda"))
    dtype: str = option("auto", "auto, float32, bfloat16 or float16.", DEVICE,
                        choices=("auto", "float32", "bfloat16", "float16"))
    # CPU only: oneDNN's GEMM on each weight reordered once at load, the dense copy freed
    # (scheduler/model/packed_gemm.py)
    weight_pack: str = option("auto", "CPU: the projections' weights reordered once for oneDNN's GEMM: auto "
                              "(where it measures faster), on or off.", DEVICE, choices=("auto", "on", "off"))
    # 0 = cores - 1, so the host thread (scheduling, tokenizer, sender, trace writer) keeps
    # a core: with every core given to OpenMP, any other runnable thread makes its barrier
    # spin and a step can get ~100x slower (measured on 2 cores, BENCHMARKS.md).
    device_threads: int = option(0, "CPU intra-op threads for the model (0 = cores - 1).", DEVICE, ge=0)
    # thread: the CPU device's streams share this process's GIL with the scheduler. process:
    # the device is a process of its own (scheduler/device/device_process.py), so host work overlaps
    # device work as it does on a GPU.
    cpu_device: str = option("auto", "CPU only: process (the device has its own interpreter, as a GPU runs apart "
                             "from the host), thread (stream threads share the scheduler's GIL), or auto "
                             "(process, unless a feature needs thread).", DEVICE,
                             choices=("auto", "thread", "process"))
    # The CPU emulation's host and device share cores (and, with cpu_device=thread, the GIL);
    # `mstrace whatif` reads the measured slowdown from meta.json (scheduler/device/contention.py).
    contention_probe: bool = option(True, "Measure at start-up how much the host and the CPU device slow each "
                                    "other, for mstrace whatif (a few forwards; --no-contention-probe skips it).",
                                    DEVICE)
    tokenizer_threads: int = option(1, "Tokenizer pool threads.", SCHEDULING, ge=1)
    seed: int = option(0, "Seed for the synthetic workload and unseeded sampling.", WORKLOAD)
    probes: bool = option(True, "Probe and memory tables (--no-probes: requests, timeline and steps only).", OUTPUT)
    wait_timeout_s: float = option(5.0, "Timeout in seconds of every wait in the engine.", FAULTS,
                                   flag="wait-timeout", gt=0, le=7 * 24 * 3600)
    snapshot_every: int = option(50, "Full block-table snapshot every N rounds (0 = never).", OUTPUT, ge=0)
    # The truth harness (scheduler/harness/debug_delay.py): (place, ms) delays that a test checks
    # the cost table charges to the right row.
    debug_delay_ms: tuple[tuple[str, float], ...] = option(
        (), "Test-only: PLACE=MS, a known delay (repeatable).", FAULTS, hidden=True, cli_type=list[str] | None,
        cli_default=None, parse=_delays, check=_known_delays)
    inject: tuple[str, ...] = option((), "Fault injection: deadlock, leak, slow-sender, starve, stall-rank "
                                     "(repeatable).", FAULTS, check=_known_faults)
    gc: bool = option(True, "The periodic GC scan that reclaims blocks of dead or stuck holders (--no-gc: a leak "
                      "stays visible).", MEMORY)
    gc_after_s: float = option(10.0, "GC reclaims blocks of dead or stuck holders after this long.", MEMORY,
                                  ge=0)
    on_stall: str = option("abort", "abort (flush the trace, exit 3) or continue, when a wait passes "
                           "--wait-timeout.", FAULTS, choices=("abort", "continue"))
    # Test-only: verify on the device stream that no KV slot is read before its write,
    # and (negative control) drop the cross-stream event waits that guarantee it.
    debug_kv_check: bool = option(False, "Test-only: check on the device that no KV slot is read before its "
                                  "write.", FAULTS, hidden=True)
    debug_skip_stream_waits: bool = option(False, "Test-only: drop the cross-stream event waits.", FAULTS,
                                           hidden=True)
    # Tensor x pipeline parallel (scheduler/parallel/): this process is rank 0 and spawns the
    # other tp * pp - 1 ranks.
    tp: int = option(1, "Tensor-parallel ranks (gloo on CPU, nccl on CUDA); this process is rank 0.", PARALLEL,
                     ge=1)
    pp: int = option(1, "Pipeline-parallel stages; --tp x --pp ranks in all.", PARALLEL, ge=1)
    comm_overlap: bool = option(True, "on: hide each TP all-reduce behind the other half of the batch "
                                "(scheduler/parallel/tp.py); off: synchronous.", PARALLEL, cli_type=str,
                                cli_default="on", parse=_on_off)
    # pp > 1: cut each round's batch at a sequence boundary into this many parts (1 or 2), so
    # the next stage computes the first while this stage computes the second.
    pp_microbatches: int = option(2, "--pp > 1: pipeline each round's batch in 1 or 2 parts (2: the next stage "
                                  "computes the first half while this one computes the second).", PARALLEL,
                                  choices=(1, 2))

    def validate(self) -> None:
        """Each field against its own declaration (scheduler/options.py), then the rules
        between fields; ConfigError with the first problem, one line."""
        check_fields(self)
        for problem in cross_field_problems(self):
            raise ConfigError(problem)

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

    def resolved_cpu_device(self) -> str:
        """thread or process; `auto`: a device process, unless a feature needs the device
        in this process (see validate)."""
        if self.cpu_device != "auto":
            return self.cpu_device
        return "thread" if self._needs_in_process_device() else "process"

    def _needs_in_process_device(self) -> list[str]:
        """Features that hand the device Python objects, which cannot cross a process."""
        return [flag for flag, on in (("--tp/--pp > 1", self.world_size > 1),
                                      ("the KV ordering check", self.debug_kv_check)) if on]

    def resolved_device_threads(self) -> int:
        return self.device_threads if self.device_threads > 0 else max(1, (os.cpu_count() or 1) - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cross_field_problems(c: EngineConfig) -> Iterator[str]:
    """The rules between fields, in one place (a field's own choices and bounds are
    declared on it): what is wrong, one line each."""
    if c.kv_blocks is not None and c.kv_bytes is not None:
        yield "give the KV pool size in blocks or in bytes, not both"
    if "deadlock" in c.inject and not c.split_on:
        yield "--inject deadlock needs split streams: use --mode overlap"
    if "stall-rank" in c.inject and c.world_size < 2:
        yield "--inject stall-rank needs more than one rank (--tp or --pp > 1)"
    if c.cpu_device == "process" and (clash := c._needs_in_process_device()):  # (auto picks thread for these)
        # These hand the device Python callables or host objects, which cannot cross a process.
        yield f"--cpu-device process does not support {', '.join(clash)}; use --cpu-device thread"
    if c.world_size > 1 and c.kv_layout == "contiguous":
        # defragmentation moves rank 0's KV shard only: the other ranks would read their old
        # block ids (the batch wire carries rounds, not block moves)
        yield "--kv-layout contiguous cannot be used with --tp/--pp > 1 (its block moves reach rank 0's cache only)"
    if c.world_size > 1 and (c.overlap_on or c.split_on):
        # Rounds run serially across ranks (scheduler/parallel/coordinator.py): a placeholder
        # token lives in rank 0's future ring only, and split streams would interleave two
        # forwards' collectives. `mstrace run` switches both off for --tp/--pp > 1.
        if c.overlap_schedule or c.split_streams:
            yield ("--overlap-schedule and --split-streams cannot be used with --tp/--pp > 1 "
                   "(rounds run serially across ranks)")
        else:
            yield (f"--mode {c.mode} needs overlap scheduling and split streams, which --tp/--pp > 1 cannot "
                   "run (rounds run serially across ranks): use --mode serial or timeslice")


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
    except (ValueError, OverflowError) as e:  # "1e999" is inf
        raise ConfigError(f"cannot read size {text!r}") from e
