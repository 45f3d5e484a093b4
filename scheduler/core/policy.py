"""Scheduling policy: steps 1-3 of a round (scan, group, allocate).

FCFS admission as in the seed: the waiting queue is scanned in arrival order
and the scan stops at the first request that does not fit. Chunked prefill
caps the prefill tokens of a round at `prefill_chunk` (time-slice mode: one
`timeslice_chunk` per round). Decodes run every round.

Every decision that delays a request leaves a timeline event:
  * preempted (value = tokens to recompute): a decode needed a block and the
    pool was empty, or a prefill waited past `prefill_max_wait_ms` for blocks;
    the most recently admitted running request loses its blocks (vLLM's
    recompute policy) and goes back to the front of the waiting queue;
  * decode_priority: a decode waited past `decode_max_wait_ms` since its last
    token, so this round runs decodes only (no prefill): a waiting decode is not starved by prefills.
  * fence_wait (value = blocks behind the fence): a decode needed a block, none
    was free, but released blocks were still behind the KV fence; it skips
    this round instead of evicting more.
"""

from __future__ import annotations

from collections.abc import Callable

from probes.clock import now_ns
from scheduler.config import EngineConfig
from scheduler.core.batch import ScheduleBatch, ScheduledChunk
from scheduler.core.memory_manager import MemoryManager, PrefixMatch
from scheduler.core.request import FinishReason, Request
from scheduler.core.request_manager import RequestManager


class Policy:
    def __init__(
        self,
        cfg: EngineConfig,
        rm: RequestManager,
        mm: MemoryManager,
        release: Callable[[Request], None] | None = None,
        pending_free: Callable[[], int] = lambda: 0,
    ) -> None:
        self.cfg = cfg
        self.rm = rm
        self.mm = mm
        # Frees a request's blocks behind the engine's KV fence; plain free by default.
        self._release = release or self._free_now
        self._pending_free = pending_free  # blocks released but still behind the KV fence
        self._reserve = int(cfg.watermark_frac * mm.num_blocks)
        self._timeslice = cfg.mode == "timeslice"
        self._contiguous = cfg.kv_layout == "contiguous"
        # Contiguous layout: blocks the head request needs when enough are free
        # but no run is long enough (the engine's defragmentation trigger).
        self.fragmented_need = 0

    def schedule(self, step: int) -> ScheduleBatch:
        batch = ScheduleBatch(step)
        now = now_ns()
        self._group_decodes(batch)
        if self._decode_starved(batch, now):
            return batch
        budget = self.cfg.timeslice_chunk if self._timeslice else self.cfg.prefill_chunk
        budget = self._continue_prefills(batch, budget)
        if self._timeslice and batch.prefills:
            return batch  # time-slice: exactly one prefill chunk per cycle
        self._admit_waiting(batch, budget, now)
        return batch

    def _decode_starved(self, batch: ScheduleBatch, now: int) -> bool:
        limit = int(self.cfg.decode_max_wait_ms * 1e6)
        for c in batch.decodes:
            last = c.req.token_ns[-1] if c.req.token_ns else c.req.first_token_ns
            if last and now - last > limit:
                self.rm.mark(c.req, "decode_priority", (now - last) // 1_000_000)
                return True
        return False

    # step 2 (decode group) + step 3 for decodes: a decode only needs a new
    # block when its next token crosses a block boundary.
    def _group_decodes(self, batch: ScheduleBatch) -> None:
        bs = self.mm.block_size
        for req in list(self.rm.running):
            if req not in self.rm.running or not req.is_decoding:
                continue  # preempted below as a victim, or still prefilling
            if len(req.output_ids) >= req.sample.sampling_params.max_new_tokens:
                continue  # its last token is in flight; it finishes when that lands
            while req.num_tokens > len(req.block_table) * bs:
                if self.mm.num_free > 0:
                    self.mm.append_block(req.request_id, req.block_table)
                    continue
                pending = self._pending_free()
                if pending:
                    # Blocks already released come back once the KV fence passes (next
                    # round); evicting more now frees nothing sooner and, when every
                    # decode does it, preempts the whole batch in a loop that never ends.
                    self.rm.mark(req, "fence_wait", pending)
                    break
                victim = self._pick_victim(batch)
                self._preempt(victim, batch, "no free block for a decode")
                if victim is req:
                    break
            else:
                batch.decodes.append(ScheduledChunk(req, req.num_computed, 1, True, req.num_preemptions))

    def _continue_prefills(self, batch: ScheduleBatch, budget: int) -> int:
        for req in self.rm.running:
            if budget <= 0 or (self._timeslice and batch.prefills):
                break
            if req.is_decoding or req.num_uncomputed == 0:
                continue
            budget -= self._add_prefill(batch, req, budget)
        return budget

    # step 1 (scan) + step 3 (allocate) for new requests.
    def _admit_waiting(self, batch: ScheduleBatch, budget: int, now: int) -> None:
        mm = self.mm
        while self.rm.waiting and budget > 0 and len(self.rm.running) < self.cfg.max_running:
            if self._timeslice and batch.prefills:
                break
            req = self.rm.waiting[0]
            worst = mm.blocks_needed(req.sample.valid_len + req.sample.sampling_params.max_new_tokens)
            if worst > self.capacity:
                self._reject(req, worst)
                continue
            if self._contiguous:
                if not self._admit_contiguous(req, worst):
                    break
                budget -= self._add_prefill(batch, req, budget)
                continue
            tokens = req.token_ids()
            prefix, need = self._blocks_to_take(req, tokens)
            if need > mm.num_free - self._reserve:
                if not self._evict_for(req, need, batch, now):
                    break  # seed step 1: stop at the first request that does not fit
                # A victim may have held some of the matched blocks: they are free now.
                prefix, need = self._blocks_to_take(req, tokens)
                if need > mm.num_free - self._reserve:
                    break  # evicted, but the blocks come back only after the KV fence
            req.block_table = mm.allocate(req.request_id, len(tokens), prefix)
            req.num_computed = req.num_cached_prefix = prefix.num_blocks * mm.block_size
            req.num_hashed_blocks, req.last_block_hash = prefix.num_blocks, prefix.last_hash
            self.rm.admit(req)
            budget -= self._add_prefill(batch, req, budget)

    def _blocks_to_take(self, req: Request, tokens: list[int]) -> tuple[PrefixMatch, int]:
        """The prompt's prefix match, and the free-list blocks admitting it takes: fresh ones
        plus matched blocks that nobody holds (they leave the free list too). A request that
        scores its prompt (prompt_logprobs) matches nothing: a cached position is never computed,
        so it would have no logits."""
        sp = req.sample.sampling_params
        prefix = self.mm.match_prefix(tokens) if sp.prompt_logprobs is None else PrefixMatch()
        return prefix, self.mm.blocks_needed(len(tokens)) - prefix.num_blocks + prefix.num_from_free

    def _admit_contiguous(self, req: Request, need: int) -> bool:
        """One run for the request's whole life (prompt + max_new_tokens): no growth, no sharing."""
        self.fragmented_need = 0
        if need > self.mm.num_free - self._reserve:
            return False
        table = self.mm.allocate_run(req.request_id, need)
        if table is None:
            self.fragmented_need = need  # enough free blocks, but scattered
            return False
        req.block_table = table
        req.num_computed = req.num_cached_prefix = 0
        self.rm.admit(req)
        return True

    def _evict_for(self, req: Request, need: int, batch: ScheduleBatch, now: int) -> bool:
        """Starvation remedy: a prefill waiting past prefill_max_wait_ms for blocks evicts decodes."""
        waited = now - req.wait_since_ns
        # A request that was itself evicted waits for blocks to free up
        # naturally; letting victims evict in turn makes the pool thrash.
        if waited < self.cfg.prefill_max_wait_ms * 1e6 or not self.rm.running or req.num_preemptions:
            return False
        evicted = False
        while need > self.mm.num_free + self._pending_free() - self._reserve and self.rm.running:
            victim = self._pick_victim(batch)
            self._preempt(victim, batch, f"{req.request_id} waited {waited // 1_000_000} ms for blocks", req)
            evicted = True
        return evicted

    def _add_prefill(self, batch: ScheduleBatch, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed, budget)
        batch.prefills.append(ScheduledChunk(req, req.num_computed, n, req.num_computed + n == req.num_tokens,
                                             req.num_preemptions))
        return n

    def _pick_victim(self, batch: ScheduleBatch) -> Request:
        # Last admitted loses: it has the least invested work (vLLM's recompute policy).
        return self.rm.running[-1]

    def _preempt(self, victim: Request, batch: ScheduleBatch, why: str, behind: Request | None = None) -> None:
        batch.decodes = [c for c in batch.decodes if c.req is not victim]
        batch.prefills = [c for c in batch.prefills if c.req is not victim]
        self._release(victim)
        victim.drop_placeholders()
        self.rm.preempt(victim, why, behind)

    def _free_now(self, req: Request) -> None:
        self.mm.free(req.request_id, req.block_table)
        req.block_table = []

    @property
    def capacity(self) -> int:
        """The most blocks one request may ever hold: the pool less the watermark reserve,
        which admission never hands out. A request whose prompt and max_new_tokens need more
        could run only by growing into the reserve, and once preempted (its prompt and
        outputs re-admitted together) never be admitted again: it would hold the queue, and
        evict every decode behind it, for good. So it is rejected as it arrives."""
        return self.mm.num_blocks - self._reserve

    def _reject(self, req: Request, worst: int) -> None:
        sp = req.sample
        n = self.mm.num_blocks
        kept = f" less the {self._reserve} kept back at admission (--watermark-frac)" if self._reserve else ""
        if self.mm.blocks_needed(sp.valid_len) > self.capacity:
            why = (f"prompt of {sp.valid_len} tokens needs {self.mm.blocks_needed(sp.valid_len)} blocks; "
                   f"the KV pool has {n}{kept}")
        else:
            why = (f"prompt + max_new_tokens = {sp.valid_len + sp.sampling_params.max_new_tokens} tokens "
                   f"needs {worst} blocks; the KV pool has {n}{kept}")
        self.rm.finish(req, FinishReason.REJECTED, why)
