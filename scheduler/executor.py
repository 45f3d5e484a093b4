"""The Executor: step 4 of a round. It turns a ScheduleBatch into a forward pass
over the paged KV cache and samples the next tokens.

prepare() is host work (index tensors, one host->device copy); forward() is
device work. They are separate calls because that seam is where overlap
scheduling later puts the next round's host work under this round's device work.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from probes.boundaries import SCHEDULER_BARRIER
from probes.recorder import Row
from probes.waits import WaitRegistry, timed_wait
from scheduler.batch import ScheduleBatch, ScheduledChunk
from scheduler.model.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.sampling import sample
from scheduler.model.transformer import CausalLM
from scheduler.request import Request
from scheduler.streams import Event, Stream


@dataclass(slots=True)
class PreparedBatch:
    forward: ForwardBatch
    sampled: list[ScheduledChunk]  # chunks that produce a token, in logits-row order
    temperatures: list[float]
    top_ps: list[float]
    generators: list[torch.Generator | None]


class Executor:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        block_size: int,
        device: torch.device,
        seed: int,
        streams: dict[str, Stream],
        registry: WaitRegistry,
        wait_timeout_s: float,
        probe_buf: list[Row] | None,
        rank: int = 0,
    ) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.seed = seed
        self.streams = streams
        self.registry = registry
        self.wait_timeout_s = wait_timeout_s
        self._buf = probe_buf
        self._rank = rank
        # The last submitted forward: KV blocks it reads must not be reused before it completes.
        self.last_event: Event | None = None

    def prepare(self, batch: ScheduleBatch) -> PreparedBatch:
        chunks = batch.chunks
        seqs: list[SeqChunk] = []
        for c in chunks:
            toks = c.req.token_ids()[c.start : c.start + c.num_tokens]
            seqs.append(SeqChunk(toks, c.start, c.req.block_table, c.sample))
        sampled = [c for c in chunks if c.sample]
        params = [c.req.sample.sampling_params for c in sampled]
        return PreparedBatch(
            forward=build_forward_batch(seqs, self.block_size, self.device),
            sampled=sampled,
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            generators=[self._generator(c.req) for c in sampled],
        )

    def forward(self, prepared: PreparedBatch, step: int) -> list[int]:
        """Serial: submit to the main stream, then block on its event (the scheduler barrier)."""
        main = self.streams["main"]
        result: list[list[int]] = []
        main.submit(lambda: result.append(self.run_model(prepared)), f"forward#{step}", step)
        ev = main.record()
        self.last_event = ev
        timed_wait(ev.wait, registry=self.registry, waiter="scheduler", what=f"event {ev.label}",
                   signaller="main-stream", boundary=SCHEDULER_BARRIER, timeout_s=self.wait_timeout_s,
                   buf=self._buf, rank=self._rank, step=step)
        if main.error is not None:
            raise RuntimeError(f"forward failed on the main stream: {main.error!r}") from main.error
        return result[0]

    def run_model(self, prepared: PreparedBatch) -> list[int]:
        """Device work: the forward pass and sampling."""
        logits = self.model(prepared.forward, self.kv)
        if not prepared.sampled:
            return []
        return sample(logits, prepared.temperatures, prepared.top_ps, prepared.generators)

    def _generator(self, req: Request) -> torch.Generator | None:
        sp = req.sample.sampling_params
        if sp.temperature <= 0:
            return None
        if req.generator is None:
            # Unseeded requests still get a reproducible stream: derived from the
            # run seed and the request id, never from global RNG state.
            seed = sp.seed if sp.seed is not None else zlib.crc32(f"{self.seed}:{req.request_id}".encode())
            req.generator = torch.Generator(device=self.device).manual_seed(seed)
        gen: torch.Generator = req.generator
        return gen
