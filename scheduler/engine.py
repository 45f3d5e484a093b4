"""The Engine: owns the parts and drives one scheduling round per step().

A round is five steps:
  1 scan     pull tokenized requests, scan the waiting queue (FCFS)
  2 group    decode group = running requests with one uncomputed token;
             prefill group = new and partially prefilled requests
  3 allocate KV blocks for admitted prompts and for decodes crossing a block
  4 submit   assemble the batch and run one forward on the executor
  5 collect  append sampled tokens, finish requests, free their blocks,
             hand new tokens to the sender thread
Steps 1-3 live in core/policy.py, step 4 in device/executor.py (launching on the backend
chosen in device/backend.py), step 5 in core/collect.py; the order of it all is here.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.boundaries import (
    DEFRAG,
    IDLE,
)
from probes.clock import now_ns
from probes.recorder import Probes
from probes.waits import WaitRegistry, WaitTimeout, timed_wait
from probes.watchdog import Watchdog
from scheduler.config import DEFAULT_KV_TOKENS, EngineConfig
from scheduler.core.aborts import AbortInbox
from scheduler.core.batch import ScheduleBatch
from scheduler.core.collect import collect, launched
from scheduler.core.kv_fence import KvFence
from scheduler.core.memory_manager import MemoryManager, append_snapshot, plan_moves
from scheduler.core.policy import Policy
from scheduler.core.reclaim import Reclaimer
from scheduler.core.request import FinishReason, Request, SamplingParams
from scheduler.core.request_manager import RequestManager
from scheduler.device.backend import choose_backend, device_of
from scheduler.device.contention import NoRoom
from scheduler.device.contention import measure as measure_contention
from scheduler.device.executor import Executor
from scheduler.device.prepared import Launch
from scheduler.device.streams import CpuStream
from scheduler.device.work import MAIN, PREFILL
from scheduler.harness import debug_delay as dd
from scheduler.harness.debug_delay import delay_ns
from scheduler.harness.faults import hooks_for
from scheduler.harness.process_settings import ProcessSettings
from scheduler.hops.sender import FinishedRecord, OutputSink, Sender, StepOutput
from scheduler.hops.tokenizer import Tokenizer, TokenizerError
from scheduler.hops.tokenizer_pool import TokenizerPool
from scheduler.model.dtypes import dtype_of
from scheduler.model.presets import resolve_model
from scheduler.model.sampling import SampledLists
from scheduler.options import ConfigError
from scheduler.round_record import InFlight, RoundClock, StepsRow
from scheduler.stall_guard import StallGuard
from tracing.writer import TraceWriter

if TYPE_CHECKING:
    from scheduler.device.device_process import DeviceSeed
    from scheduler.parallel.coordinator import Coordinator




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
        device_seed: DeviceSeed | None = None,
    ) -> None:
        config.validate()
        self.cfg = config
        # faults and the truth harness's delays; the default does nothing
        self.hooks = hooks_for(config)
        device_delay = delay_ns(config.debug_delay_ms, dd.DEVICE_COMPUTE)
        self.model_dir: Path = resolve_model(config.model)
        self.settings = ProcessSettings()  # restored by close()
        # TP/PP (scheduler/parallel/coordinator.py): this process is rank 0 and holds one shard.
        self.parallel = parallel
        if device_of(config).type == "cpu":  # before the weights load: their GEMM's layout follows it (packed_gemm)
            self.settings.set_threads(config.resolved_device_threads())
        self.backend = choose_backend(config, self.model_dir, dtype_of(config.dtype), device_delay, parallel,
                                      device_seed)
        self.device = self.backend.device
        self.model_config = self.backend.model_config
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(self.model_dir)
        except TokenizerError:
            self.tokenizer = None  # ids-only workloads still run
        self.eos_ids = frozenset(self.model_config.eos_token_id or ())

        num_blocks = self._pool_blocks(self.backend.kv_bytes_per_block(config.block_size))
        self.trace = trace
        self.probes = Probes(trace.buffer if trace is not None and config.probes else None, rank=0)
        self._pb = self.probes.buffer()  # the scheduling thread's own probe buffer
        self._round_clock: Callable[[], RoundClock] = RoundClock  # trace_ranges swaps it
        self._mem_buf = self.probes.table_buffer("memory")
        self.registry = WaitRegistry()
        self.backend.open(num_blocks, config.block_size, self.probes, self.registry)
        self.streams, self.device_proc = self.backend.streams, self.backend.device_proc
        self.rm = RequestManager(self._timeline_sink())
        self.mm = MemoryManager(num_blocks, config.block_size, self._memory_sink(),
                                config.enable_prefix_sharing and config.kv_layout == "paged")
        self._inflight: InFlight | None = None  # overlap mode: the batch launched last round
        self.fence = KvFence(self.mm, config.split_on, self._pb, 0)
        self.policy = Policy(config, self.rm, self.mm, self._release, lambda: self.fence.blocks)
        self.executor = Executor(self.backend.ops, config.block_size, config.seed, self.streams, self.registry,
                                 config.hard_wait_timeout_s, self._pb, eos_ids=self.eos_ids)
        if config.debug_kv_check:  # (validate keeps it to a local device)
            self.backend.ops.enable_kv_check()
        self.contention = self._probe_contention(num_blocks)
        self.pool = TokenizerPool(self.tokenizer, config.tokenizer_threads, self.probes)
        self.sender = Sender(self.tokenizer, list(sinks), self.probes, self.hooks.before_deliver)
        self.reclaimer = Reclaimer(config.gc_after_s) if config.gc else None
        self.stalls = StallGuard(trace.buffer("stalls") if trace is not None else None)
        self.watchdog = Watchdog(self.registry, config.wait_timeout_s, on_stall=self.stalls.on_stall,
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
        self.aborts = AbortInbox()
        self.hooks.at_start(self)

    # ---- set-up --------------------------------------------------------
    def _probe_contention(self, num_blocks: int) -> dict[str, Any]:
        """meta.json's `contention`: measured where the device is this machine's CPU, before
        the first round; otherwise only why not."""
        cfg = self.cfg
        why = ("--no-contention-probe" if not cfg.contention_probe
               else "no trace to record it" if self.trace is None
               else "a GPU computes beside the host" if self.device.type != "cpu"
               else "a TP/PP forward needs every rank" if self.parallel is not None
               else "a fault is injected" if cfg.inject or cfg.debug_skip_stream_waits
               else "the test-only KV check is on" if cfg.debug_kv_check
               else "the forward holds a debug delay" if delay_ns(cfg.debug_delay_ms, dd.DEVICE_COMPUTE)
               else None)
        if why is None:
            try:
                return measure_contention(self.streams, self.backend.ops, cfg.block_size, num_blocks,
                                          self.backend.ops.device, self.registry).to_json()
            except NoRoom as e:
                why = str(e)
            except BaseException:  # the device failed or hung: the engine does not start, nor leak
                try:
                    self.backend.close()
                finally:
                    self.settings.restore()
                raise
        return {"why": why}

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
        prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
        arrival_ns: int | None = None, add_special_tokens: bool = True,
    ) -> str:
        """Hand a request to the tokenizer pool. Thread-safe; returns its id. A text prompt
        gets the tokenizer's special tokens (BOS) unless `add_special_tokens` is false."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        with self._submit_lock:
            self._submitted += 1  # before the pool can hand it back, so has_work() never misses it
        try:
            self.pool.submit(rid, prompt if isinstance(prompt, str) else list(prompt),
                             params or SamplingParams(), now_ns() if arrival_ns is None else arrival_ns,
                             add_special_tokens)
        except BaseException:
            with self._submit_lock:  # refused: it will never arrive, so nothing waits for it
                self._submitted -= 1
            raise
        return rid

    @property
    def submitted(self) -> int:
        """Requests submitted so far (what an interrupted run's end record reports)."""
        return self._submitted

    def has_work(self) -> bool:
        # a request rejected as it arrived (in wait_for_arrivals) is finished but not yet
        # handed to the sender: one more round takes it, or the last one would be lost
        return (len(self.rm) > 0 or self._received < self._submitted or self._inflight is not None
                or bool(self.fence) or self.rm.has_undrained())

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

    def drive(self, arriving: Callable[[], bool], on_round: Callable[[StepStats], None] | None = None,
              idle_poll_s: float = 0.02) -> None:
        """The one loop that runs an engine (`run`, `serve`, the tests): a round, else a wait
        for arrivals, until no request can still arrive (`arriving()` false) and none is left."""
        while arriving() or self.has_work():
            stats = self.step()
            if stats is None:
                self.wait_for_arrivals(idle_poll_s)
            elif on_round is not None:
                on_round(stats)
        self.finish_run()

    def trace_ranges(self, clock: Callable[[], RoundClock]) -> None:
        """Stamp each round with `clock`: one that also opens a profiler's ranges
        (scheduler/harness/torch_profile.py)."""
        self._round_clock = clock

    def step(self) -> StepStats | None:
        """One scheduling round. Returns None when there was nothing to run or collect.

        serial / timeslice: schedule, launch, wait, collect.
        overlap (a): schedule and launch round N, then wait for and collect
        round N-1, so the host's work for N runs under the device's work for N-1.
        """
        clock = self._round_clock()
        step = self._intake()
        batch = self.policy.schedule(step)  # steps 1-3
        clock.scheduled = now_ns()
        launches = self._launch(batch, step) if batch else []  # step 4
        clock.launched = now_ns()
        done = self._swap_inflight(InFlight(batch, launches) if batch else None)
        tokens = self._barrier(done)
        clock.synced = now_ns()
        out = self._collect(done, tokens, clock.synced)  # step 5
        if done is None and not batch:
            if out.finished:
                self.sender.queue.put(out)
            return None
        clock.pause = self._housekeeping(step, clock.synced)
        clock.housekept = now_ns()
        device_ns = self._record(clock, step, batch, done)
        self.sender.queue.put(out)  # after the round's steps row (tracing/schema.py DRAIN_ORDER)
        self.hooks.after_send()
        clock.sent = now_ns()
        if self._pb is not None:
            clock.send_row(self._pb, self.probes.rank, step)
        self.hooks.between_rounds()
        return StepStats(step, clock.start, clock.sent - clock.start, device_ns, len(batch.prefills),
                         batch.num_prefill_tokens, len(batch.decodes), sum(len(t.tokens) for t in tokens),
                         len(out.finished))

    def _intake(self) -> int:
        """A new round: the tokenized arrivals queued, the aborts asked for taken, the blocks
        whose readers have finished freed."""
        self.step_no += 1
        step = self.rm.step = self.step_no
        self._drain_arrivals()
        for req, why in self.aborts.take(itertools.chain(self.rm.running, self.rm.waiting),
                                         self._received < self._submitted):
            self._finish(req, FinishReason.ABORTED, why)
        self.fence.free_completed(step)
        return step

    def _swap_inflight(self, launched: InFlight | None) -> InFlight | None:
        """The batch this round collects: in overlap mode the one launched a round ago (this
        round's stays in flight), else this round's own."""
        if not self.cfg.overlap_on:
            return launched
        done, self._inflight = self._inflight, launched
        return done

    def _barrier(self, done: InFlight | None) -> list[SampledLists]:
        """The scheduler barrier: wait for the collected batch's device work."""
        if done is None:
            return []
        try:
            got = [self.executor.wait(la) for la in done.launches]
        except (WaitTimeout, RuntimeError) as e:
            raise self.stalls.stalled(e, lambda: self.watchdog.reporting) from e
        self.stalls.got_through()
        return got

    def _housekeeping(self, step: int, now: int) -> tuple[int, int]:
        """Defragment, reclaim orphans, snapshot the block table, as due; the defrag pause's
        (start, end), which is not bookkeeping."""
        pause = (0, 0)
        if self.policy.fragmented_need and self.mm.num_free > self.cfg.defrag_free_frac * self.mm.num_blocks:
            pause = self._defrag(step)
        if self.reclaimer is not None and self.reclaimer.due(now):
            self._gc(now)
        if self.cfg.snapshot_every and step % self.cfg.snapshot_every == 0 and self._mem_buf is not None:
            append_snapshot(self._mem_buf, step, self.mm, self.rm.running)
        self.hooks.end_of_bookkeeping()
        return pause

    def _record(self, clock: RoundClock, step: int, batch: ScheduleBatch, done: InFlight | None) -> int:
        """The round's host probe rows, then its steps row, which ends at the hand-off: a
        requests row that names this round is never in the trace without the round's own
        row. Returns the collected batch's device time."""
        device_ns = sum(la.device_ns() for la in done.launches) if done is not None else 0
        if self._pb is not None:
            clock.host_rows(self._pb, self.probes.rank, step, bool(batch))
        if self._steps_buf is not None:
            t0, dur = clock.start, clock.housekept - clock.start
            self._steps_buf.append(StepsRow(
                step, self.cfg.mode, t0, dur, max(0, dur - device_ns), device_ns, len(batch.prefills),
                batch.num_prefill_tokens, len(batch.decodes), batch.num_decode_tokens, self.mm.num_used,
                self.mm.num_free, len(self.rm.waiting), len(self.rm.running), self.sender.queue.qsize(),
                clock.synced if done is not None else 0, self.fence.blocks))
        return device_ns

    def request_abort(self, request_id: str, detail: str) -> None:
        """Thread-safe: abort this request at the next round (scheduler/core/aborts.py)."""
        self.aborts.post(request_id, detail)

    def abort(self, request_id: str) -> bool:
        for req in list(self.rm.running) + list(self.rm.waiting):
            if req.request_id == request_id:
                self._finish(req, FinishReason.ABORTED, "aborted by caller")
                return True
        return False

    def close(self) -> None:
        self.watchdog.stop()
        self.pool.shutdown()
        self.backend.close()
        self.hooks.device_held(self.backend.device_held())
        try:
            self.sender.close()
        finally:
            self.settings.restore()

    def device_stream_times(self) -> dict[str, dict[str, int]]:
        """A device thread's streams (`--cpu-device thread`): their recorded compute ops in all,
        wall and CPU (the end record's `device_stream_times`; docs/trace-schema.md). Empty for
        TP/PP, whose rank 0's forwards also wait for the other ranks off its CPU clock."""
        if self.parallel is not None:
            return {}
        return {name: {"ops": t[0], "wall_ns": t[1], "cpu_ns": t[2]} for name, st in self.streams.items()
                if isinstance(st, CpuStream) and (t := st.compute_times)[0]}

    def _kv_summary(self) -> dict[str, Any]:
        mm = self.mm
        return {"num_blocks": mm.num_blocks, "free": mm.num_free, "fenced": self.fence.blocks,
                "holders": {rid: len(t) for rid, t in list(mm.tables.items())[:64]},
                "largest_free_run": mm.largest_free_run() if self.cfg.kv_layout == "contiguous" else None}

    # ---- step internals ------------------------------------------------
    def _drain_arrivals(self) -> None:
        ready = self.pool.ready
        while not ready.empty():
            self._enqueue(ready.get_nowait())

    def _enqueue(self, sample: Any) -> None:
        self._received += 1
        if sample.sampling_params.fill_context:  # what the context and the blocks one request may hold leave
            room = min(self.model_config.max_position_embeddings, self.policy.capacity * self.mm.block_size)
            sample.sampling_params = replace(sample.sampling_params, max_new_tokens=max(room - sample.valid_len, 1))
        req = self.rm.enqueue(sample)
        if (why := self.aborts.arrived(sample.request_id)) is not None:
            self.rm.finish(req, FinishReason.ABORTED, why)
        elif why := sample.refusal(self.model_config.vocab_size, self.model_config.max_position_embeddings,
                                   logits_on_rank0=self.cfg.pp == 1):
            self.rm.finish(req, FinishReason.REJECTED, why)

    def _launch(self, batch: ScheduleBatch, step: int) -> list[Launch]:
        """Step 4: prepare and enqueue the batch, one launch per stream; does not wait."""
        for c in batch.prefills:
            c.req.num_prefill_chunks += 1
            c.req.progress_ns = self.rm.mark(c.req, "prefill_chunk", c.num_tokens)
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
            launched(chunks, la.prepared.sampled, la.slots)
            for c in chunks:
                c.req.last_event = la.end
            launches.append(la)
        return launches

    def _collect(self, done: InFlight | None, tokens: list[SampledLists], now: int) -> StepOutput:
        """Step 5 (scheduler/core/collect.py), and the requests that finished, for the sender."""
        out = StepOutput(self.step_no)
        if done is not None:
            split = [la.prepared.results(toks, la.slots) for la, toks in zip(done.launches, tokens, strict=True)]
            results = itertools.chain.from_iterable(r for r, _ in split)
            scores = [c for _, s in split for c in s]
            collect(results, done.batch.chunks, self.step_no, now, self.mm, self.rm, self.eos_ids, self._finish, out,
                    scores)
        self._emit_finished(out)
        return out

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
        # every launch is done: the blocks held behind the KV fence (requests finished while
        # their last round was in flight) are free now, and the runs may move over them
        self.fence.free_completed(step)
        moves = plan_moves(self.rm.running, self.mm, self.rm.mark)
        if moves:
            src, dst = [a for a, _ in moves], [b for _, b in moves]
            self.streams[MAIN].submit(self.backend.ops.copy_work(src, dst), f"defrag#{step}", step, DEFRAG)
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
        """Give a request's blocks back, behind the KV fence (scheduler/core/kv_fence.py)."""
        self.fence.release(req, [la.end for la in self._inflight.launches] if self._inflight is not None else [], kind)

    def _emit_finished(self, out: StepOutput) -> None:
        out.finished += self.fence.hand_over(self.rm.drain_finished(), FinishedRecord.of)
