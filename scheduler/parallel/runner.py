"""One rank's share of a tensor x pipeline parallel model, and one forward step over it.

Every rank builds the same :class:`~scheduler.model.forward_batch.ForwardBatch` from the same
``SeqChunk`` list and calls :meth:`ShardedModel.step`; the logits come back on
``state.logits_rank`` (TP rank 0 of the last stage) and None everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from probes.recorder import ProbeRow
from probes.waits import WaitRegistry
from scheduler.model.config import ModelConfig
from scheduler.model.forward_batch import ForwardBatch
from scheduler.model.kv_cache import PagedKVCache, block_bytes
from scheduler.model.loader import load_model
from scheduler.model.transformer import CausalLM

from .comm import COMM_TIMEOUT_S, AllReduce
from .group import ParallelState
from .pp import PipelineStage, stage_layers, stage_part
from .tp import TPRunner, slice_batch, split_row, tp_config, tp_shard_fn, validate_tp


def check_shardable(cfg: ModelConfig, tp: int, pp: int) -> None:
    """ModelLoadError if --tp/--pp cannot split this model: said before any rank is started
    (each rank would load the model, then fail on the same check)."""
    validate_tp(cfg, tp)
    stage_layers(cfg.num_hidden_layers, pp, 0)


@dataclass(slots=True)
class ShardedModel:
    state: ParallelState
    full_cfg: ModelConfig  # the checkpoint's
    cfg: ModelConfig  # this rank's shapes (heads, KV heads, intermediate divided by tp)
    model: CausalLM  # this rank's layers and, per stage, embedding / head
    stage: PipelineStage
    tp: TPRunner | None  # None when tp_size == 1
    registry: WaitRegistry  # every wait of this rank's forward (for the stall watchdog)
    microbatches: int = 2  # pp > 1: a round's batch in this many pipelined parts (1 or 2)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        state: ParallelState,
        *,
        dtype: torch.dtype | None = None,
        overlap: bool = False,
        probe_buf: list[ProbeRow] | None = None,
        registry: WaitRegistry | None = None,
        timeout_s: float = COMM_TIMEOUT_S,
        microbatches: int = 2,
        pack: bool = False,
    ) -> ShardedModel:
        """Load this rank's shard of the checkpoint at ``model_dir`` (each tensor read whole,
        sliced, copied: peak extra memory is one checkpoint tensor)."""
        full = ModelConfig.from_file(Path(model_dir) / "config.json")
        registry = registry if registry is not None else WaitRegistry()
        comm = None
        if state.tp_size > 1:
            comm = AllReduce(
                state.tp_group, state.rank, buf=probe_buf, registry=registry, timeout_s=timeout_s
            )
        model, cfg = load_model(
            model_dir,
            state.device,
            dtype,
            tp_shard_fn(full, state.tp_rank, state.tp_size) if comm else None,
            cfg=tp_config(full, state.tp_size),
            part=stage_part(full, state),
            all_reduce=comm,
            pack=pack,
        )
        tp = TPRunner(model, comm, overlap) if comm else None
        stage = PipelineStage(
            model, state, tp, buf=probe_buf, registry=registry, timeout_s=timeout_s
        )
        return cls(state, full, cfg, model, stage, tp, registry, microbatches)

    @property
    def overlap(self) -> bool:
        return self.tp is not None and self.tp.overlap

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """This stage's layers x this rank's KV heads."""
        return self.model.make_kv_cache(num_blocks, block_size)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """KV bytes one block costs on this rank (its stage's layers, its KV heads)."""
        return block_bytes(len(self.model.layers), self.cfg.num_key_value_heads, self.cfg.head_dim, block_size,
                           self.model.dtype)

    def step(self, batch: ForwardBatch, kv: PagedKVCache, step: int = -1) -> torch.Tensor | None:
        """One forward step on this rank; logits on the logits rank, None elsewhere."""
        if self.tp is not None:
            self.tp.comm.step = step
        st, stage = self.state, self.stage
        row = split_row(batch) if st.pp_size > 1 and self.microbatches > 1 else None
        parts = [batch] if row is None else [slice_batch(batch, 0, row), slice_batch(batch, row, batch.num_tokens)]
        # Every rank builds the same batch, so every rank cuts it at the same row.
        outs = []
        for mb in parts:
            hidden_in = None if st.is_first_stage else stage.recv_hidden(mb.num_tokens, step)
            x = stage.layers_forward(mb, kv, hidden_in)
            if st.is_last_stage:
                outs.append(x)
            else:
                stage.send_hidden(x, step)  # async: the next stage starts on it while this one goes on
        if st.is_last_stage:
            return stage.logits(outs[0] if len(outs) == 1 else torch.cat(outs), batch)
        stage.flush()
        return None
