"""The model, KV pool and future-token ring in this process: CPU stream threads, CUDA
streams, or rank 0's shard under TP/PP (whose forward the coordinator runs with every
rank). What a stream runs for it are closures over this object."""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from scheduler.core.batch import ScheduledChunk
from scheduler.device.prepared import KvReadCheck, PreparedBatch
from scheduler.device.work import FUTURE_SLOTS, Work
from scheduler.harness.debug_delay import HeldForward, hold
from scheduler.model.forward_batch import ForwardBatch
from scheduler.model.forward_step import ModelStep, forward_step
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.sampling import Sampled

if TYPE_CHECKING:
    from scheduler.parallel.coordinator import Coordinator


class LocalDevice:
    builds_batch_on_host = True  # the forward batch's index tensors are made by prepare()

    def __init__(self, model: Any, kv: PagedKVCache, device: torch.device, block_size: int,
                 parallel: Coordinator | None = None, debug_delay_ns: int = 0) -> None:
        # the truth harness: a known hold inside every forward
        self.held = HeldForward(model, debug_delay_ns, partial(_device_hold, device=device)) \
            if debug_delay_ns else None
        self.model: Any = self.held or model
        self.kv, self.device, self.block_size, self.parallel = kv, device, block_size, parallel
        self.future = torch.zeros(FUTURE_SLOTS, dtype=torch.long, device=device)
        # Test-only stream-ordering check: every KV slot is tagged (position, token) when a
        # stream writes it; a read must find the tag it expects, in stream execution order.
        self.kv_tags: torch.Tensor | None = None
        self.kv_violations: list[str] = []

    def enable_kv_check(self) -> None:
        self.kv_tags = torch.full((self.kv.k[0].shape[0],), -1, dtype=torch.long, device=self.device)

    @property
    def kv_check_on(self) -> bool:
        return self.kv_tags is not None

    def forward_work(self, prepared: PreparedBatch, slots: list[int], step: int, out: list[Any]) -> Work:
        return lambda: out.append(self.run_model(prepared, slots, step))

    def sleep_work(self, us: float) -> Work:
        return lambda: _device_sleep(us, self.device)

    def copy_work(self, src: list[int], dst: list[int]) -> Work:
        """The device work of a defragmentation copy, for a stream to run."""
        return lambda: self.copy_blocks(src, dst)

    def run_model(self, prepared: PreparedBatch, slots: list[int], step: int = -1) -> Sampled:
        """Device work: step 4's `forward_step` with this device's model. The tokens stay on
        the device; on a GPU they are copied to pinned host memory without waiting, ahead of
        the launch's end event, which the barrier waits for."""
        fb = prepared.forward
        assert fb is not None, "prepare() builds the forward batch for a local device"
        par = self.parallel
        receive = None
        if par is not None:  # TP/PP rank 0: broadcast the batch, run this shard; a PP run's tokens come back
            def model(fb: ForwardBatch, kv: PagedKVCache) -> torch.Tensor | None:
                return par.shard_step(prepared, kv, step)

            receive = partial(par.tokens, prepared, step)
        else:
            assert self.model is not None
            model = self.model
        if self.kv_tags is not None:  # the test-only ordering check reads the resolved batch
            model = partial(self._checked, model, prepared)
        out = forward_step(model, fb, self.kv, prepared.sampling, self.future, slots, prepared.has_placeholders,
                           receive)
        assert out is not None, "rank 0 always gets tokens"
        return out.to_host(non_blocking=True)

    def _checked(self, model: ModelStep, prepared: PreparedBatch, fb: ForwardBatch,
                 kv: PagedKVCache) -> torch.Tensor | None:
        self._check_kv(prepared)
        return model(fb, kv)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Device work: move KV blocks (defragmentation); test-only tags move with them."""
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

    def kv_reads(self, chunks: Sequence[ScheduledChunk]) -> KvReadCheck:
        bs = self.block_size
        slots, pos, toks = [], [], []
        for c in chunks:
            ids = c.req.token_ids()
            for p in range(c.start):
                slots.append(c.req.block_table[p // bs] * bs + p % bs)
                pos.append(p)
                toks.append(ids[p])

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=self.device)

        return KvReadCheck(t(slots), t(pos), t(toks))


def _device_hold(ns: int, device: torch.device) -> int | None:
    """A known delay inside the forward: on a GPU a kernel that spins (the host is not
    held); on the CPU the stream thread is the device."""
    if device.type == "cuda":
        # ~1 GHz: cycles ~ ns
        torch.cuda._sleep(ns)  # type: ignore[no-untyped-call]  # torch leaves _sleep unannotated
        return None
    return hold(ns)


def _device_sleep(us: float, device: torch.device) -> None:
    if device.type == "cuda":
        # ~1 GHz: cycles ~ ns. A device-side delay, so the host is never blocked.
        torch.cuda._sleep(int(us * 1000))  # type: ignore[no-untyped-call]  # torch leaves _sleep unannotated
    else:
        time.sleep(us / 1e6)
