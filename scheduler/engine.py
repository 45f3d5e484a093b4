"""The Engine: owns the parts and drives one scheduling round per step().

A round is the seed's five steps:
  1 scan     pull tokenized requests, scan the waiting queue (FCFS)
  2 group    decode group = running requests with one uncomputed token;
             prefill group = new and partially prefilled requests
  3 allocate KV blocks for admitted prompts and for decodes crossing a block
  4 submit   assemble the batch and run one forward on the executor
  5 collect  append sampled tokens, finish requests, free their blocks,
             hand new tokens to the sender thread
Steps 1-3 live in policy.py, step 4 in executor.py, step 5 here.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from probes.boundaries import (
    BATCH_PREPARE,
    BOOKKEEPING,
    DEFRAG,
    IDLE,
    KV_FENCE,
    RESPONSE_SEND,
    SCHEDULER_BARRIER,
)
from probes.clock import now_ns
from probes.recorder import Probes
from probes.waits import WaitRegistry, WaitTimeout, timed_wait
from probes.watchdog import StallReport, Watchdog
from scheduler import debug_delay as dd
from scheduler.batch import ScheduleBatch
from scheduler.config import DEFAULT_KV_TOKENS, ConfigError, EngineConfig
from scheduler.debug_delay import delay_ns
from scheduler.device_process import DeviceProcess, DeviceSpec
from scheduler.executor import FUTURE_SLOTS, Executor, Launch
from scheduler.faults import hooks_for
from scheduler.memory_manager import MemoryManager
from scheduler.model.config import ModelConfig
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.loader import load_model
from scheduler.model.presets import resolve_model
from scheduler.model.transformer import CausalLM
from scheduler.policy import Policy
from scheduler.process_settings import ProcessSettings
from scheduler.reclaim import Reclaimer
from scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from scheduler.request_manager import RequestManager
from scheduler.sender import FinishedRecord, OutputSink, Sender, StepOutput
from scheduler.streams import MAIN, PREFILL, Event, Stream, make_streams
from scheduler.tokenizer import Tokenizer, TokenizerError
from scheduler.tokenizer_pool import TokenizerPool
from tracing.writer import TraceWriter

if TYPE_CHECKING:
    from scheduler.parallel.coordinator import Coordinator


class EngineStalled(RuntimeError):
    """A wait passed its timeout with --on-stall abort; the watchdog's reports say why."""

    def __init__(self, reports: list[StallReport], cause: BaseException) -> None:
        # The most telling report: a wait cycle, else the wait underneath the scheduler's barrier
        # (e.g. a collective some rank never joined), else the first.
        rep = (next((r for r in reports if r.cycle), None)
               or next((r for r in reports if r.wait.boundary != SCHEDULER_BARRIER), None)
               or (reports[0] if reports else None))
        what = (rep.cycle_name or rep.wait.what) if rep is not None else str(cause)
        super().__init__(f"engine stalled: {what}")
        self.reports = reports


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class StepStats:
    step: int
    ts_ns: int
    dur_ns: int
    dur_device_ns: int
    num_prefill_reqs: int
    num_prefill_tokens: int
    num_decode_reqs: int
    num_sampled: int
    num_finished: int


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        sinks: Sequence[OutputSink] = (),
        trace: TraceWriter | None = None,
        parallel: Coordinator | None = None,
    ) -> None:
        config.validate()
        self.cfg = config
        # faults and the truth harness's delays; the default does nothing
        self.hooks = hooks_for(config)
        device_delay = delay_ns(config.debug_delay_ms, dd.DEVICE_COMPUTE)
        self.model_dir: Path = resolve_model(config.model)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.settings = ProcessSettings()  # restored by close()
        if self.device.type == "cpu":
            self.settings.set_threads(config.resolved_device_threads())
        dtype = _DTYPES.get(config.dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        # TP/PP (scheduler/parallel/coordinator.py): this process is rank 0 and holds one shard.
        self.parallel = parallel
        # --cpu-device process: the model and KV pool live in the device process.
        self.device_proc: DeviceProcess | None = None
        remote = self.device.type == "cpu" and config.resolved_cpu_device() == "process"
        self.model: CausalLM | None = None
        if parallel is None and remote:
            self.model_config = ModelConfig.from_file(self.model_dir / "config.json")
            per_block = PagedKVCache.bytes_per_block(self.model_config, config.block_size, dtype)
        elif parallel is None:
            self.model, self.model_config = load_model(self.model_dir, self.device, dtype)
            per_block = PagedKVCache.bytes_per_block(self.model_config, config.block_size, dtype)
        else:
            self.model_config = ModelConfig.from_file(self.model_dir / "config.json")
            per_block = parallel.kv_bytes_per_block(self.model_config, config.block_size, dtype)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(self.model_dir)
        except TokenizerError:
            self.tokenizer = None  # ids-only workloads still run
        self.eos_ids = frozenset(self.model_config.eos_token_id or ())

        num_blocks = self._pool_blocks(per_block)
        self.trace = trace
        self.probes = Probes(trace.buffer if trace is not None and config.probes else None, rank=0)
        self._pb = self.probes.buffer()  # the scheduling thread's own probe buffer
        self._mem_buf = self.probes.buffer("memory")
        self.registry = WaitRegistry()
        self.kv: PagedKVCache | None = None
        if parallel is None and remote:
            self.device_proc = DeviceProcess(DeviceSpec(
                str(self.model_dir), str(dtype).removeprefix("torch."), num_blocks, config.block_size,
                config.resolved_device_threads(), config.hard_wait_timeout_s, FUTURE_SLOTS,
                device_delay), self.probes,
                self.registry)
        elif parallel is None:
            mc = self.model_config
            self.kv = PagedKVCache(mc.num_hidden_layers, num_blocks, config.block_size,
                                   mc.num_key_value_heads, mc.head_dim, dtype, self.device)
        else:
            # Every rank gets the same block count (the block tables are rank 0's); the engine's
            # registry, so the watchdog sees rank 0's collective waits.
            sharded = parallel.start_ranks(self.model_dir, num_blocks, dtype, self.probes, self.registry)
            self.model = sharded.model
            self.kv = sharded.make_kv_cache(num_blocks, config.block_size)
        self.streams: dict[str, Stream] = (
            dict(self.device_proc.streams) if self.device_proc is not None
            else make_streams(self.device, self.probes, self.registry, config.hard_wait_timeout_s))
        self.rm = RequestManager(self._timeline_sink())
        self.mm = MemoryManager(num_blocks, config.block_size, self._memory_sink(),
                                config.enable_prefix_sharing and config.kv_layout == "paged")
        self._inflight: tuple[ScheduleBatch, list[Launch]] | None = None
        self._fenced: list[tuple[list[Event], str, list[int], str]] = []
        self._fenced_blocks = 0
        # Finished requests whose blocks wait behind the fence: their records go to the
        # sender once the blocks are free, so a committed requests row never precedes
        # its frees in the trace (tracing/schema.py DRAIN_ORDER).
        self._fenced_finish: dict[str, FinishedRecord] = {}
        self._unfenced: list[str] = []
        self.policy = Policy(config, self.rm, self.mm, self._release, lambda: self._fenced_blocks)
        self.executor = Executor(self.model, self.kv, config.block_size, self.device, config.seed,
                                 self.streams, self.registry, config.hard_wait_timeout_s, self._pb,
                                 parallel=parallel, debug_delay_ns=device_delay)
        if config.debug_kv_check:
            self.executor.enable_kv_check()
        self.pool = TokenizerPool(self.tokenizer, config.tokenizer_threads, self.probes)
        self.sender = Sender(self.tokenizer, list(sinks), self.probes, self.hooks.before_deliver)
        self.reclaimer = Reclaimer(config.gc_after_s) if config.gc else None
        self.stalls: list[StallReport] = []
        self._stall_buf = trace.buffer("stalls") if trace is not None else None
        self.watchdog = Watchdog(self.registry, config.wait_timeout_s, on_stall=self._on_stall,
                                 streams=lambda: [st.state() for st in self.streams.values()],
                                 kv_summary=self._kv_summary, step=lambda: self.step_no,
                                 extra_stacks=self.device_proc.stacks if self.device_proc is not None else None)
        self.watchdog.start()
        self._steps_buf = trace.buffer("steps") if trace else None
        self.settings.freeze_gc()  # everything allocated so far is long-lived
        self.step_no = 0
        self._ids = itertools.count()
        self._submit_lock = threading.Lock()
        self._submitted = 0
        self._received = 0
        self.hooks.at_start(self)

    # ---- set-up --------------------------------------------------------
    def _pool_blocks(self, per_block: int) -> int:
        """Pool size in blocks; ``per_block`` = KV bytes of one block on this process."""
        cfg = self.cfg
        if cfg.kv_blocks is not None:
            return cfg.kv_blocks
        if cfg.kv_bytes is not None:
            n = cfg.kv_bytes // per_block
            if n < 1:
                raise ConfigError(f"--kv-bytes {cfg.kv_bytes} is smaller than one KV block ({per_block} bytes)")
            return n
        return max(1, DEFAULT_KV_TOKENS // cfg.block_size)

    def _timeline_sink(self) -> Any:
        if self.trace is None:
            return None
        buf = self.trace.buffer("timeline")
        return lambda ts, rid, stage, step, value: buf.append((ts, rid, stage, step, value))

    def _memory_sink(self) -> Any:
        buf = self._mem_buf
        if buf is None:
            return None
        return lambda kind, bid, rid, ref: buf.append((now_ns(), self.step_no, kind, bid, rid, ref))

    # ---- the public API ------------------------------------------------
    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_ns: int | None = None,
    ) -> str:
        """Hand a request to the tokenizer pool. Thread-safe; returns its id."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        with self._submit_lock:
            self._submitted += 1
        self.pool.submit(rid, prompt if isinstance(prompt, str) else list(prompt),
                         params or SamplingParams(), now_ns() if arrival_ns is None else arrival_ns)
        return rid

    @property
    def submitted(self) -> int:
        """Requests submitted so far (what an interrupted run's end record reports)."""
        return self._submitted

    def has_work(self) -> bool:
        return (len(self.rm) > 0 or self._received < self._submitted or self._inflight is not None
                or bool(self._fenced))

    def wait_for_arrivals(self, timeout_s: float) -> None:
        """Idle engine: block until a tokenized request is ready or the timeout passes."""
        got: list[Any] = []

        def ready(slice_s: float) -> bool:
            try:
                got.append(self.pool.ready.get(timeout=slice_s) if slice_s > 0 else self.pool.ready.get_nowait())
                return True
            except Exception:  # queue.Empty
                return False

        timed_wait(ready, registry=self.registry, waiter="scheduler", what="queue tokenized",
                   signaller="tokenizer-pool", boundary=IDLE, timeout_s=timeout_s, buf=self._pb,
                   step=self.step_no, raise_on_timeout=False)
        for sample in got:
            self._enqueue(sample)

    def step(self) -> StepStats | None:
        """One scheduling round. Returns None when there was nothing to run or collect.

        serial / timeslice: schedule, launch, wait, collect.
        overlap (a): schedule and launch round N, then wait for and collect
        round N-1, so the host's work for N runs under the device's work for N-1.
        """
        pb = self._pb
        t0 = now_ns()
        self.step_no += 1
        step = self.rm.step = self.step_no
        self._drain_arrivals()
        self._release_fenced()
        batch = self.policy.schedule(step)  # steps 1-3
        t1 = now_ns()
        launches = self._launch(batch, step) if batch else []  # step 4
        t2 = now_ns()
        if self.cfg.overlap_on:
            done, self._inflight = self._inflight, (batch, launches) if batch else None
        else:
            done = (batch, launches) if batch else None
        out = StepOutput(step)
        tokens: list[list[int]] = []
        device_ns = 0
        if done is not None:
            try:
                tokens = [self.executor.wait(la) for la in done[1]]  # the scheduler barrier
            except (WaitTimeout, RuntimeError) as e:
                raise self._stalled(e) from e
            device_ns = sum(la.device_ns() for la in done[1])
        t3 = now_ns()
        if done is not None:
            self._collect(done[0], done[1], tokens, out, t3)  # step 5
        self._emit_finished(out)
        if done is None and not batch:
            if out.finished:
                self.sender.queue.put(out)
            return None
        pause = (0, 0)
        if self.policy.fragmented_need and self.mm.num_free > self.cfg.defrag_free_frac * self.mm.num_blocks:
            pause = self._defrag(step)
        if self.reclaimer is not None and self.reclaimer.due(t3):
            self._gc(t3)
        if self.cfg.snapshot_every and step % self.cfg.snapshot_every == 0:
            self._snapshot_blocks(step)
        self.hooks.end_of_bookkeeping()
        t4 = now_ns()
        n_sampled = sum(len(t) for t in tokens)
        r = self.probes.rank
        if pb is not None:
            pb.append((t0, t1 - t0, BOOKKEEPING, "host", r, step))
            if batch:
                pb.append((t1, t2 - t1, BATCH_PREPARE, "host", r, step))
            if pause[1]:  # the defrag pause is its own row, not bookkeeping
                pb.append((t3, pause[0] - t3, BOOKKEEPING, "host", r, step))
                pb.append((pause[1], t4 - pause[1], BOOKKEEPING, "host", r, step))
            else:
                pb.append((t3, t4 - t3, BOOKKEEPING, "host", r, step))
        if self._steps_buf is not None:
            # Appended before the tokens leave for the sender: a requests row that
            # names this round is never in the trace without the round's own row
            # (tracing/schema.py DRAIN_ORDER). So the row ends at the hand-off, t4.
            self._steps_buf.append((
                step, self.cfg.mode, t0, t4 - t0, max(0, (t4 - t0) - device_ns), device_ns,
                len(batch.prefills), batch.num_prefill_tokens, len(batch.decodes), len(batch.decodes),
                self.mm.num_used, self.mm.num_free, len(self.rm.waiting), len(self.rm.running),
                self.sender.queue.qsize(), t3 if done is not None else 0,
            ))
        self.sender.queue.put(out)
        self.hooks.after_send()
        t5 = now_ns()
        if pb is not None:
            pb.append((t4, t5 - t4, RESPONSE_SEND, "host", r, step))
        self.hooks.between_rounds()
        stats = StepStats(step, t0, t5 - t0, device_ns, len(batch.prefills), batch.num_prefill_tokens,
                          len(batch.decodes), n_sampled, len(out.finished))
        return stats

    def abort(self, request_id: str) -> bool:
        for req in list(self.rm.running) + list(self.rm.waiting):
            if req.request_id == request_id:
                self._finish(req, FinishReason.ABORTED, "aborted by caller")
                return True
        return False

    def close(self) -> None:
        self.watchdog.stop()
        self.pool.shutdown()
        for s in self.streams.values():
            s.close()
        if self.device_proc is not None:
            self.device_proc.close()
        try:
            self.sender.close()
        finally:
            self.settings.restore()

    # ---- stalls ----------------------------------------------------------
    def _on_stall(self, report: StallReport) -> None:
        """Watchdog thread: keep the evidence in the trace and say it at once."""
        self.stalls.append(report)
        if self._stall_buf is not None:
            self._stall_buf.append(report.to_row())
        print(report.render_text(), file=sys.stderr, flush=True)

    def _stalled(self, cause: BaseException) -> BaseException:
        # The watchdog reports at wait_timeout; the wait itself gives up a little
        # later, so by now the report exists (give its thread a moment if not).
        deadline = now_ns() + 500_000_000
        while not self.stalls and now_ns() < deadline and isinstance(cause, WaitTimeout):
            time.sleep(0.01)
        if self.stalls or isinstance(cause, WaitTimeout):
            return EngineStalled(list(self.stalls), cause)
        return cause

    def _kv_summary(self) -> dict[str, Any]:
        mm = self.mm
        return {"num_blocks": mm.num_blocks, "free": mm.num_free, "fenced": self._fenced_blocks,
                "holders": {rid: len(t) for rid, t in list(mm.tables.items())[:64]},
                "largest_free_run": mm.largest_free_run() if self.cfg.kv_layout == "contiguous" else None}

    # ---- step internals ------------------------------------------------
    def _drain_arrivals(self) -> None:
        ready = self.pool.ready
        while not ready.empty():
            self._enqueue(ready.get_nowait())

    def _enqueue(self, sample: Any) -> None:
        self._received += 1
        req = self.rm.enqueue(sample)
        if sample.error:
            self.rm.finish(req, FinishReason.REJECTED, sample.error)
        elif sample.valid_len == 0:
            self.rm.finish(req, FinishReason.REJECTED, "empty prompt")
        elif max(sample.input_ids) >= self.model_config.vocab_size or min(sample.input_ids) < 0:
            bad = next(t for t in sample.input_ids if not 0 <= t < self.model_config.vocab_size)
            self.rm.finish(req, FinishReason.REJECTED,
                           f"token id {bad} is outside the vocabulary of {self.model_config.vocab_size}")

    def _launch(self, batch: ScheduleBatch, step: int) -> list[Launch]:
        """Step 4: prepare and enqueue the batch, one launch per stream; does not wait."""
        for c in batch.prefills:
            c.req.num_prefill_chunks += 1
            self.rm.mark(c.req, "prefill_chunk", c.num_tokens)
            if not c.req.first_scheduled_ns:
                c.req.first_scheduled_ns = self.rm.mark(c.req, "first_scheduled")
        if self.cfg.split_on:
            # (b) primary/secondary: decode on main, prefill on its own stream
            groups = [(MAIN, batch.decodes, 0.0), (PREFILL, batch.prefills, self.cfg.prefill_stagger_us)]
        else:
            groups = [(MAIN, batch.chunks, 0.0)]
        self.hooks.before_launch(self, batch, step)
        launches = []
        for stream, chunks, stagger in groups:
            if not chunks:
                continue
            # KV and future tokens written on another stream must be visible first.
            wait_for = {id(c.req.last_event): c.req.last_event for c in chunks
                        if c.req.last_event is not None and c.req.last_event.stream != stream
                        and not c.req.last_event.query()}
            la = self.executor.launch(self.executor.prepare(chunks), stream, step,
                                      self.hooks.cross_stream_waits(list(wait_for.values())), stagger)
            for c in chunks:
                c.req.num_computed += c.num_tokens
                c.req.last_event = la.end
            for c, slot in zip(la.prepared.sampled, la.slots, strict=True):
                c.req.output_ids.append(-(slot + 1))  # placeholder until the token lands
            launches.append(la)
        return launches

    def _collect(
        self, batch: ScheduleBatch, launches: list[Launch], tokens: list[list[int]], out: StepOutput, now: int
    ) -> None:
        """Step 5: replace placeholders with tokens, finish requests, publish full blocks."""
        mm, rm = self.mm, self.rm
        for la, toks in zip(launches, tokens, strict=True):
            for c, tok, slot in zip(la.prepared.sampled, toks, la.slots, strict=True):
                req = c.req
                if req.status is RequestStatus.FINISHED or c.generation != req.num_preemptions:
                    continue  # finished or preempted while this round was in flight
                req.output_ids[req.output_ids.index(-(slot + 1), req.num_real_outputs)] = tok
                req.token_ns.append(now)
                runs = req.token_runs
                if runs and runs[-2] + runs[-1] == self.step_no:
                    runs[-1] += 1
                else:
                    runs += (self.step_no, 1)
                out.tokens.append((req.request_id, tok))
                if not req.first_token_ns:
                    req.first_token_ns = rm.mark(req, "first_token")
                sp = req.sample.sampling_params
                if tok in self.eos_ids and not sp.ignore_eos:
                    self._finish(req, FinishReason.EOS)
                elif req.num_real_outputs >= sp.max_new_tokens:
                    self._finish(req, FinishReason.LENGTH)
        for c in batch.chunks:
            req = c.req
            if req.status is not RequestStatus.RUNNING or c.generation != req.num_preemptions:
                continue
            # Only tokens known on the host can be hashed; in overlap mode the
            # next round may already have computed one more (a placeholder).
            known = min(req.num_computed, req.sample.valid_len + req.num_real_outputs)
            if known // mm.block_size > req.num_hashed_blocks:
                req.num_hashed_blocks, req.last_block_hash = mm.register_full_blocks(
                    req.token_ids(), req.block_table, known, req.num_hashed_blocks, req.last_block_hash)

    def _finish(self, req: Request, reason: FinishReason, detail: str = "", kind: str = "free") -> None:
        if self.hooks.finish(self, req):
            return
        self._release(req, kind)
        req.drop_placeholders()  # a token of the next round may be in flight: it is discarded
        self.rm.finish(req, reason, detail)

    def _defrag(self, step: int) -> tuple[int, int]:
        """Move every live run to the low end of the pool, scheduling paused.

        Waits until no stream has work that could touch the old positions,
        then copies the KV on the main stream and waits for that too.
        """
        t0 = now_ns()
        self._wait_streams_idle(step)
        holders = sorted((r for r in self.rm.running if r.block_table), key=lambda r: r.block_table[0])
        moves: list[tuple[int, int]] = []
        moved = {}
        at = 0
        for req in holders:
            m = self.mm.move(req.request_id, req.block_table, at)
            at += len(req.block_table)
            if m:
                moves += m
                moved[req.request_id] = len(m)
                self.rm.mark(req, "defrag_moved", len(m))
        if moves:
            src, dst = [a for a, _ in moves], [b for _, b in moves]
            self.streams[MAIN].submit(self.executor.copy_work(src, dst), f"defrag#{step}", step, DEFRAG)
            self._wait_streams_idle(step)
        self.policy.fragmented_need = 0
        t1 = now_ns()
        if self._pb is not None:
            self._pb.append((t0, t1 - t0, DEFRAG, "host", self.probes.rank, step))
        return t0, t1

    def _wait_streams_idle(self, step: int) -> None:
        for name in (MAIN, PREFILL):
            ev = self.streams[name].record()
            timed_wait(ev.wait, registry=self.registry, waiter="scheduler", what=f"event {ev.label}",
                       signaller=f"{name}-stream", boundary=DEFRAG, timeout_s=self.cfg.hard_wait_timeout_s,
                       step=step)

    def _gc(self, now: int, force: bool = False) -> None:
        assert self.reclaimer is not None
        orphans, stuck = self.reclaimer.scan(self.rm, self.mm, now, force)
        for o in orphans:
            if self.trace is not None:
                self.trace.buffer("timeline").append((now, o.request_id, "reclaimed", self.step_no, len(o.blocks)))
        for req, why in stuck:
            self.rm.mark(req, "reclaimed", len(req.block_table))
            self._finish(req, FinishReason.ABORTED, f"gc: {why}", kind="reclaim")

    def finish_run(self) -> None:
        """End of a run: a last GC pass reclaims any orphan whatever its age."""
        if self.reclaimer is not None:
            self._gc(now_ns(), force=True)

    def _release(self, req: Request, kind: str = "free") -> None:
        """Give a request's blocks back, behind the KV fence.

        Work on one stream runs in order, so a block freed now and reused by a
        later launch on the same stream is safe without waiting. Across streams
        it is not: the blocks go back only when every in-flight launch that
        might read them has completed (the `kv_fence`).
        """
        if not req.block_table:
            return
        fence = [la.end for la in self._inflight[1]] if self._inflight is not None else []
        if req.last_event is not None:
            fence.append(req.last_event)
        if self.cfg.split_on and any(not ev.query() for ev in fence):
            self.mm.detach(req.request_id, req.block_table)
            self._fenced.append((fence, req.request_id, req.block_table, kind))
            self._fenced_blocks += len(req.block_table)
        else:
            self.mm.free(req.request_id, req.block_table, kind)
        req.block_table = []

    def _release_fenced(self) -> None:
        if not self._fenced:
            return
        keep = []
        for fence, rid, table, kind in self._fenced:
            t0 = now_ns()
            if all(ev.query() for ev in fence):
                self.mm.free(rid, table, kind)
                self._fenced_blocks -= len(table)
                self._unfenced.append(rid)
                if self._pb is not None:
                    self._pb.append((t0, now_ns() - t0, KV_FENCE, "host", self.probes.rank, self.step_no))
            else:
                keep.append((fence, rid, table, kind))
        self._fenced = keep

    def _snapshot_blocks(self, step: int) -> None:
        """A full block-table snapshot into the memory table: one row per (block, holder)."""
        buf = self._mem_buf
        if buf is None:
            return
        ts = now_ns()
        blocks = self.mm.blocks
        # A marker row, so an empty pool still shows up as a snapshot; ref_count carries the free count.
        buf.append((ts, step, "snapshot_begin", -1, "", self.mm.num_free))
        for req in self.rm.running:
            rid = req.request_id
            for bid in req.block_table:
                buf.append((ts, step, "snapshot", bid, rid, blocks[bid].ref_count))

    def _emit_finished(self, out: StepOutput) -> None:
        fenced = {rid for _, rid, _, _ in self._fenced}
        for req in self.rm.drain_finished():
            rec = FinishedRecord.of(req)
            if req.request_id in fenced:
                self._fenced_finish[req.request_id] = rec
            else:
                out.finished.append(rec)
        for rid in self._unfenced:
            if rid not in fenced and rid in self._fenced_finish:
                out.finished.append(self._fenced_finish.pop(rid))
        self._unfenced.clear()
