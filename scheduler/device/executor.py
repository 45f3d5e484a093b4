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

import zlib
from collections.abc import Sequence

from probes.boundaries import PREFILL_STAGGER, SCHEDULER_BARRIER
from probes.recorder import ProbeRow
from probes.waits import WaitRegistry, timed_wait
from scheduler.core.batch import ScheduledChunk
from scheduler.core.request import Request
from scheduler.device.prepared import Launch, PreparedBatch
from scheduler.device.work import FUTURE_SLOTS, DeviceOps, Event, Stream
from scheduler.model.forward_batch import SeqChunk, build_forward_batch
from scheduler.model.forward_step import SamplingArgs
from scheduler.model.penalties import LogitsAdjust
from scheduler.model.sampling import SampledLists, token_seed


class Executor:
    """`device`: where the forward runs (scheduler/device/local_device.py, or a device
    process's proxy in scheduler/device/device_process.py); the executor only prepares,
    launches and waits."""

    def __init__(
        self,
        device: DeviceOps,
        block_size: int,
        seed: int,
        streams: dict[str, Stream],
        registry: WaitRegistry,
        wait_timeout_s: float,
        probe_buf: list[ProbeRow] | None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.seed = seed
        self.streams = streams
        self.registry = registry
        self.wait_timeout_s = wait_timeout_s
        self._buf = probe_buf
        self._next_slot = 0
        self.eos_ids = eos_ids  # what min_tokens bans, with each request's stop_token_ids

    def prepare(self, chunks: Sequence[ScheduledChunk]) -> PreparedBatch:
        seqs: list[SeqChunk] = []
        placeholders = extras = False
        for c in chunks:
            req = c.req
            toks = req.token_ids()[c.start : c.start + c.num_tokens]
            placeholders = placeholders or toks[-1] < 0
            extras = extras or req.extras
            seqs.append(SeqChunk(toks, c.start, req.block_table, c.sample))
        score_k = score_rows(chunks, seqs) if extras else -1
        sampled = [c for c in chunks if c.sample]
        params = [c.req.sample.sampling_params for c in sampled]
        dev = self.device
        check = dev.kv_reads(chunks) if dev.kv_check_on else None
        return PreparedBatch(
            forward=build_forward_batch(seqs, self.block_size, dev.device) if dev.builds_batch_on_host else None,
            chunks=list(chunks),
            sampled=sampled,
            sampling=SamplingArgs(
                temperatures=[p.temperature for p in params],
                top_ps=[p.top_p for p in params],
                seeds=[self._draw_seed(c) for c in sampled],
                logprobs=[-1 if p.logprobs is None else p.logprobs for p in params] if extras else [],
                score_k=score_k,
                adjust=logits_adjust(sampled, self.eos_ids) if extras else None,
            ),
            has_placeholders=placeholders,
            kv_check=check,
            seqs=seqs,
        )

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
        with s.batched():
            for ev in wait_for:
                s.wait_event(ev)
            start = s.record()
            if stagger_us > 0:
                s.submit(self.device.sleep_work(stagger_us), f"stagger#{step}", step, PREFILL_STAGGER)
            launch = Launch(prepared, stream, step, self.alloc_slots(len(prepared.sampled)), start, start)
            s.submit(self.device.forward_work(prepared, launch.slots, step, launch.result), f"forward#{step}", step)
            launch.end = s.record()
        return launch

    def wait(self, launch: Launch) -> SampledLists:
        """The scheduler barrier: block until the launch's tokens (and logprobs) are on the host."""
        ev = launch.end
        timed_wait(ev.wait, registry=self.registry, waiter="scheduler", what=f"event {ev.label}",
                   signaller=f"{launch.stream}-stream", boundary=SCHEDULER_BARRIER,
                   timeout_s=self.wait_timeout_s, buf=self._buf, step=launch.step)
        err = self.streams[launch.stream].error
        if err is not None:
            raise RuntimeError(f"forward failed on the {launch.stream} stream: {err!r}") from err
        out = launch.result[0]
        return SampledLists(*out) if isinstance(out, tuple) else out.lists()

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


def score_rows(chunks: Sequence[ScheduledChunk], seqs: list[SeqChunk]) -> int:
    """Sets each chunk's score targets (prompt_logprobs); the most alternatives one asks for
    (-1: no row is scored)."""
    score_k = -1
    for c, seq in zip(chunks, seqs, strict=True):
        k = c.req.sample.sampling_params.prompt_logprobs
        if k is not None and (targets := score_targets(c)):
            seq.score_targets = targets
            score_k = max(score_k, k)
    return score_k


def score_targets(c: ScheduledChunk) -> list[int]:
    """The prompt tokens a chunk's rows are scored against (for a request with prompt_logprobs): row i, at
    position c.start + i, predicts the prompt token at the next position; only positions
    whose next token is in the prompt are scored (the last prompt row predicts an output)."""
    prompt = c.req.sample.input_ids
    end = min(c.start + c.num_tokens, c.req.sample.valid_len - 1)
    return prompt[c.start + 1 : end + 1] if end > c.start else []


def logits_adjust(sampled: Sequence[ScheduledChunk], eos_ids: frozenset[int]) -> LogitsAdjust | None:
    """The batch's logit changes (scheduler/model/penalties.py), from the sampled chunks'
    requests; None when none asks, which is all a batch without them costs."""
    adj: LogitsAdjust | None = None
    for row, c in enumerate(sampled):
        sp = c.req.sample.sampling_params
        if not sp.adjusts_logits:
            continue
        if adj is None:
            adj = LogitsAdjust([], [], [], [], [], [], [], [], [], [], [], [])
        for tok, bias in sp.logit_bias:
            adj.bias_rows.append(row)
            adj.bias_ids.append(tok)
            adj.bias_values.append(bias)
        # every earlier output, the one fed in this round included (a placeholder in overlap mode)
        outs = c.req.output_ids
        if len(outs) < sp.min_tokens:
            for tok in (*eos_ids, *sp.stop_token_ids):
                adj.ban_rows.append(row)
                adj.ban_ids.append(tok)
        if sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0:
            k = len(adj.pen_rows)
            adj.pen_rows.append(row)
            adj.repetition.append(sp.repetition_penalty)
            adj.frequency.append(sp.frequency_penalty)
            adj.presence.append(sp.presence_penalty)
            prompt = c.req.sample.input_ids if sp.repetition_penalty != 1.0 else []
            adj.hist_pen.extend([k] * (len(prompt) + len(outs)))
            adj.hist_ids.extend(prompt)
            adj.hist_ids.extend(outs)
            adj.hist_output.extend([False] * len(prompt))
            adj.hist_output.extend([True] * len(outs))
    return adj
