"""Scheduling policy: steps 1-3 of a round (scan, group, allocate).

FCFS admission as in the seed: the waiting queue is scanned in arrival order
and the scan stops at the first request that does not fit. Chunked prefill
caps the prefill tokens of a round at `prefill_chunk`; decodes always run.
When a decode must grow into a new block and none is free, the most recently
admitted running request is preempted (its blocks freed, recomputed later),
so a full pool can never wedge the engine.
"""

from __future__ import annotations

from scheduler.batch import ScheduleBatch, ScheduledChunk
from scheduler.config import EngineConfig
from scheduler.memory_manager import MemoryManager
from scheduler.request import FinishReason, Request
from scheduler.request_manager import RequestManager


class Policy:
    def __init__(self, cfg: EngineConfig, rm: RequestManager, mm: MemoryManager) -> None:
        self.cfg = cfg
        self.rm = rm
        self.mm = mm
        self._reserve = int(cfg.watermark_frac * mm.num_blocks)

    def schedule(self, step: int) -> ScheduleBatch:
        batch = ScheduleBatch(step)
        self._group_decodes(batch)
        budget = self.cfg.prefill_chunk
        budget = self._continue_prefills(batch, budget)
        self._admit_waiting(batch, budget)
        return batch

    # step 2 (decode group) + step 3 for decodes: a decode only needs a new
    # block when its next token crosses a block boundary.
    def _group_decodes(self, batch: ScheduleBatch) -> None:
        bs = self.mm.block_size
        for req in list(self.rm.running):
            if req not in self.rm.running or not req.is_decoding:
                continue  # preempted below as a victim, or still prefilling
            while req.num_tokens > len(req.block_table) * bs:
                if self.mm.num_free > 0:
                    self.mm.append_block(req.request_id, req.block_table)
                    continue
                victim = self._pick_victim(batch)
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.decodes.append(ScheduledChunk(req, req.num_computed, 1, True))

    def _continue_prefills(self, batch: ScheduleBatch, budget: int) -> int:
        for req in self.rm.running:
            if budget <= 0:
                break
            if req.is_decoding or req.num_uncomputed == 0:
                continue
            budget -= self._add_prefill(batch, req, budget)
        return budget

    # step 1 (scan) + step 3 (allocate) for new requests.
    def _admit_waiting(self, batch: ScheduleBatch, budget: int) -> None:
        mm = self.mm
        while self.rm.waiting and budget > 0 and len(self.rm.running) < self.cfg.max_running:
            req = self.rm.waiting[0]
            worst = mm.blocks_needed(req.sample.valid_len + req.sample.sampling_params.max_new_tokens)
            if worst > mm.num_blocks:
                self._reject(req, worst)
                continue
            tokens = req.token_ids()
            prefix = mm.match_prefix(tokens)
            need = mm.blocks_needed(len(tokens)) - prefix.num_blocks + prefix.num_from_free
            if need > mm.num_free - self._reserve:
                break  # seed step 1: stop at the first request that does not fit
            req.block_table = mm.allocate(req.request_id, len(tokens), prefix)
            req.num_computed = req.num_cached_prefix = prefix.num_blocks * mm.block_size
            req.num_hashed_blocks, req.last_block_hash = prefix.num_blocks, prefix.last_hash
            self.rm.admit(req)
            budget -= self._add_prefill(batch, req, budget)

    def _add_prefill(self, batch: ScheduleBatch, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed, budget)
        batch.prefills.append(ScheduledChunk(req, req.num_computed, n, req.num_computed + n == req.num_tokens))
        return n

    def _pick_victim(self, batch: ScheduleBatch) -> Request:
        # Last admitted loses: it has the least invested work (vLLM's recompute policy).
        return self.rm.running[-1]

    def _preempt(self, victim: Request, batch: ScheduleBatch) -> None:
        batch.decodes = [c for c in batch.decodes if c.req is not victim]
        self.mm.free(victim.request_id, victim.block_table)
        self.rm.preempt(victim)

    def _reject(self, req: Request, worst: int) -> None:
        sp = req.sample
        if self.mm.blocks_needed(sp.valid_len) > self.mm.num_blocks:
            why = (f"prompt of {sp.valid_len} tokens needs {self.mm.blocks_needed(sp.valid_len)} blocks; "
                   f"the KV pool has {self.mm.num_blocks}")
        else:
            why = (f"prompt + max_new_tokens = {sp.valid_len + sp.sampling_params.max_new_tokens} tokens "
                   f"needs {worst} blocks; the KV pool has {self.mm.num_blocks}")
        self.rm.finish(req, FinishReason.REJECTED, why)
