"""The Executor: step 4 of a round. It turns scheduled chunks into a forward
pass over the paged KV cache on a stream, and samples the next tokens there.

prepare() is host work (index tensors, one host->device copy); launch() only
enqueues device work and returns at once; wait() is the scheduler barrier.
Serial mode calls them back to back; overlap mode prepares and launches round
N+1 before it waits for round N.

Sampled tokens stay on the device in a ring of "future" slots (SGLang's
FutureMap, mini-sglang's token pool): a decode scheduled before its previous
token is known carries the placeholder id -(slot + 1), and the forward
replaces placeholders from the ring on the device, with no host round trip.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from probes.boundaries import PREFILL_STAGGER, SCHEDULER_BARRIER
from probes.recorder import Row
from probes.waits import WaitRegistry, timed_wait
from scheduler.core.batch import ScheduledChunk
from scheduler.core.request import Request
from scheduler.device.prepared import KvReadCheck, Launch, PreparedBatch
from scheduler.device.work import Event, RemoteOp, Stream, Work
from scheduler.harness.debug_delay import HeldForward, hold
from scheduler.model.forward_batch import (
    SeqChunk,
    build_forward_batch,
    resolve_placeholders,
)
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.sampling import publish, sample_rows, token_seed
from scheduler.model.transformer import CausalLM

if TYPE_CHECKING:
    from scheduler.parallel.coordinator import Coordinator

FUTURE_SLOTS = 1 << 16  # > 2 rounds in flight x max batch; a slot is reused only after both finished


class Executor:
    def __init__(
        self,
        model: CausalLM | None,
        kv: PagedKVCache | None,
        block_size: int,
        device: torch.device,
        seed: int,
        streams: dict[str, Stream],
        registry: WaitRegistry,
        wait_timeout_s: float,
        probe_buf: list[Row] | None,
        rank: int = 0,
        parallel: Coordinator | None = None,
        debug_delay_ns: int = 0,
    ) -> None:
        # the truth harness: a known hold inside every forward
        self.model: Any = HeldForward(model, debug_delay_ns, partial(_device_hold, device=device)) \
            if debug_delay_ns and model is not None else model
        self.parallel = parallel
        # The device is another process (scheduler/device/device_process.py): work goes there as
        # RemoteOp data; the model, KV pool and future ring live there.
        self.remote = model is None
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.seed = seed
        self.streams = streams
        self.registry = registry
        self.wait_timeout_s = wait_timeout_s
        self._buf = probe_buf
        self._rank = rank
        self.future = None if self.remote else torch.zeros(FUTURE_SLOTS, dtype=torch.long, device=device)
        self._next_slot = 0
        # Test-only stream-ordering check: every KV slot is tagged (position, token) when a
        # stream writes it; a read must find the tag it expects, in stream execution order.
        self.kv_tags: torch.Tensor | None = None
        self.kv_violations: list[str] = []

    def enable_kv_check(self) -> None:
        assert self.kv is not None, "local device only"
        self.kv_tags = torch.full((self.kv.k[0].shape[0],), -1, dtype=torch.long, device=self.device)

    def prepare(self, chunks: Sequence[ScheduledChunk]) -> PreparedBatch:
        seqs: list[SeqChunk] = []
        placeholders = False
        for c in chunks:
            toks = c.req.token_ids()[c.start : c.start + c.num_tokens]
            placeholders = placeholders or toks[-1] < 0
            seqs.append(SeqChunk(toks, c.start, c.req.block_table, c.sample))
        sampled = [c for c in chunks if c.sample]
        params = [c.req.sample.sampling_params for c in sampled]
        check = self._kv_reads(chunks) if self.kv_tags is not None else None
        return PreparedBatch(
            forward=None if self.remote else build_forward_batch(seqs, self.block_size, self.device),
            chunks=list(chunks),
            sampled=sampled,
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            seeds=[self._draw_seed(c) for c in sampled],
            has_placeholders=placeholders,
            kv_check=check,
            seqs=seqs,
        )

    def _kv_reads(self, chunks: Sequence[ScheduledChunk]) -> KvReadCheck:
        bs = self.block_size
        slots, pos, toks = [], [], []
        for c in chunks:
            ids = c.req.token_ids()
            for p in range(c.start):
                slots.append(c.req.block_table[p // bs] * bs + p % bs)
                pos.append(p)
                toks.append(ids[p])
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return KvReadCheck(t(slots), t(pos), t(toks))

    def alloc_slots(self, n: int) -> list[int]:
        s = self._next_slot
        self._next_slot = (s + n) % FUTURE_SLOTS
        return [(s + i) % FUTURE_SLOTS for i in range(n)]

    def launch(
        self,
        prepared: PreparedBatch,
        stream: str,
        step: int,
        wait_for: Sequence[Event] = (),
        stagger_us: float = 0.0,
    ) -> Launch:
        """Enqueue the forward and sampling on `stream`; returns without waiting."""
        s = self.streams[stream]
        for ev in wait_for:
            s.wait_event(ev)
        start = s.record()
        if stagger_us > 0:
            sleep = (RemoteOp("sleep", (stagger_us,)) if self.remote
                     else lambda: _device_sleep(stagger_us, self.device))
            s.submit(sleep, f"stagger#{step}", step, PREFILL_STAGGER)
        launch = Launch(prepared, stream, step, self.alloc_slots(len(prepared.sampled)), start, start)
        work: Work
        if self.remote:
            work = RemoteOp("forward", (
                [(c.token_ids, c.start_pos, c.block_table, c.sample) for c in prepared.seqs],
                prepared.temperatures, prepared.top_ps, prepared.seeds, launch.slots, prepared.has_placeholders),
                launch.result.append)
        else:
            work = lambda: launch.result.append(self.run_model(prepared, launch.slots, step))  # noqa: E731
        s.submit(work, f"forward#{step}", step)
        launch.end = s.record()
        return launch

    def wait(self, launch: Launch) -> list[int]:
        """The scheduler barrier: block until the launch's tokens are on the host."""
        ev = launch.end
        timed_wait(ev.wait, registry=self.registry, waiter="scheduler", what=f"event {ev.label}",
                   signaller=f"{launch.stream}-stream", boundary=SCHEDULER_BARRIER,
                   timeout_s=self.wait_timeout_s, buf=self._buf, rank=self._rank, step=launch.step)
        err = self.streams[launch.stream].error
        if err is not None:
            raise RuntimeError(f"forward failed on the {launch.stream} stream: {err!r}") from err
        toks = launch.result[0]
        return toks.tolist() if isinstance(toks, torch.Tensor) else toks

    def run_model(self, prepared: PreparedBatch, slots: list[int], step: int = -1) -> torch.Tensor | list[int]:
        """Device work: resolve placeholders, forward, sample, publish tokens to the future ring.
        The tokens stay on the device; on a GPU they are copied to pinned host memory without
        waiting, ahead of the launch's end event, which the barrier waits for."""
        fb, kv, future = prepared.forward, self.kv, self.future
        assert fb is not None and kv is not None and future is not None, "local device only"
        if prepared.has_placeholders:
            resolve_placeholders(fb, future)
        if self.kv_tags is not None:
            self._check_kv(prepared)
        if self.parallel is not None:
            # TP/PP rank 0: broadcast the batch, run this shard, sample or receive the tokens.
            tokens = self.parallel.forward(prepared, kv, step)
            if tokens:
                publish(future, slots, tokens)
            return tokens
        assert self.model is not None
        logits = self.model(fb, kv)
        if not prepared.sampled:
            return []
        toks = sample_rows(logits, prepared.temperatures, prepared.top_ps, prepared.seeds)
        publish(future, slots, toks)
        if toks.device.type != "cuda":
            return toks
        host = torch.empty(len(slots), dtype=torch.long, pin_memory=True)
        host.copy_(toks, non_blocking=True)
        return host

    def copy_work(self, src: list[int], dst: list[int]) -> Work:
        """The device work of a defragmentation copy, for a stream to run."""
        return RemoteOp("copy", (src, dst)) if self.remote else lambda: self.copy_blocks(src, dst)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Device work: move KV blocks (defragmentation); test-only tags move with them."""
        assert self.kv is not None, "local device only"
        self.kv.copy_blocks(src, dst)
        if self.kv_tags is not None:
            bs = self.block_size
            s = torch.tensor([b * bs + i for b in src for i in range(bs)], device=self.device)
            d = torch.tensor([b * bs + i for b in dst for i in range(bs)], device=self.device)
            self.kv_tags[d] = self.kv_tags[s].clone()

    def _check_kv(self, prepared: PreparedBatch) -> None:
        tags, chk, fb = self.kv_tags, prepared.kv_check, prepared.forward
        assert tags is not None and chk is not None and fb is not None
        if len(chk.slots):
            got = tags[chk.slots]
            want = (chk.positions << 32) + chk.tokens.clamp(min=0)
            ok = torch.where(chk.tokens < 0, (got >> 32) == chk.positions, got == want)
            if not bool(ok.all()):
                bad = int((~ok).sum())
                self.kv_violations.append(f"{bad} KV slots read before the write that fills them")
        tags[fb.slot_mapping] = (fb.positions << 32) + fb.input_ids

    def _draw_seed(self, c: ScheduledChunk) -> int | None:
        """The seed of the draw for the token at position c.start + c.num_tokens."""
        if c.req.sample.sampling_params.temperature <= 0:
            return None
        return token_seed(self._seed(c.req), c.start + c.num_tokens)

    def _seed(self, req: Request) -> int:
        # Unseeded requests still get a reproducible stream: derived from the
        # run seed and the request id, never from global RNG state.
        sp = req.sample.sampling_params
        return sp.seed if sp.seed is not None else zlib.crc32(f"{self.seed}:{req.request_id}".encode())


def _device_hold(ns: int, device: torch.device) -> None:
    """A known delay inside the forward: on a GPU a kernel that spins (the host is not
    held); on the CPU the stream thread is the device."""
    if device.type == "cuda":
        torch.cuda._sleep(ns)  # ~1 GHz: cycles ~ ns
    else:
        hold(ns)


def _device_sleep(us: float, device: torch.device) -> None:
    if device.type == "cuda":
        # ~1 GHz: cycles ~ ns. A device-side delay, so the host is never blocked.
        torch.cuda._sleep(int(us * 1000))
    else:
        time.sleep(us / 1e6)
