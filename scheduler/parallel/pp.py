"""Pipeline parallelism: contiguous layer ranges per stage, hidden states passed point to point.

Stage 0 embeds, the last stage applies the final norm and the LM head (on TP rank 0 only, see
``tp.py``), and each stage holds only its layers' weights and KV cache.  Between stages the
``[T, hidden]`` hidden states go from a rank to the same TP position of the next stage
(``rank + tp_size``); every TP rank of a stage holds the full, all-reduced hidden states, so each
sends its own copy and no gather is needed.  ``T`` is known on every rank from the batch, which
is built identically everywhere, so no shape is exchanged.

The receive is the stage's idle time waiting for its input: it goes through
:func:`probes.waits.timed_wait` as a ``pp_bubble`` probe row.  Micro-batches (``ShardedModel.step``)
shrink the bubble: a round's batch is cut at a sequence boundary into two halves, and a stage
starts sending the first half's hidden states (an async ``isend``) before it computes the
second, so the next stage computes half A while this one computes half B.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from probes.boundaries import PP_BUBBLE
from probes.recorder import ProbeRow
from probes.waits import WaitRegistry, timed_wait
from scheduler.model.config import ModelConfig, ModelLoadError, ModelPart
from scheduler.model.forward_batch import ForwardBatch
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.transformer import CausalLM

from .comm import COMM_STREAM, COMM_TIMEOUT_S, p2p_ready
from .group import ParallelState
from .tp import TPRunner


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Checkpoint layers of stage ``pp_rank``: balanced contiguous ranges, the remainder going
    to the first stages (the last one also runs the LM head)."""
    if not 1 <= pp_size <= num_layers:
        raise ModelLoadError(f"pp_size {pp_size} must be between 1 and the {num_layers} layers")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside [0, {pp_size})")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def stage_part(cfg: ModelConfig, state: ParallelState) -> ModelPart:
    """What this rank holds: its stage's layers, the embedding on the first stage, the head on
    the last stage's TP rank 0 (the only rank that computes logits)."""
    layers = stage_layers(cfg.num_hidden_layers, state.pp_size, state.pp_rank)
    return ModelPart(
        layers.start,
        len(layers),
        embed=state.is_first_stage,
        head=state.is_last_stage and state.tp_rank == 0,
    )


class PipelineStage:
    """One rank's stage: its layers (``layers_forward``), the LM head on the last stage's logits
    rank (``logits``), and the send/receive of hidden states."""

    __slots__ = ("model", "state", "tp", "buf", "registry", "timeout_s", "_sends", "_host_blocking")

    def __init__(
        self,
        model: CausalLM,
        state: ParallelState,
        tp: TPRunner | None = None,
        *,
        buf: list[ProbeRow] | None = None,
        registry: WaitRegistry | None = None,
        timeout_s: float = COMM_TIMEOUT_S,
    ) -> None:
        self.model = model
        self.state = state
        self.tp = tp
        self.buf = buf
        self.registry = registry if registry is not None else WaitRegistry()
        self.timeout_s = timeout_s
        # isend buffers must stay alive and unmodified until their work completes.
        self._sends: list[tuple[dist.Work, torch.Tensor, int]] = []
        self._host_blocking = state.pp_group is None or dist.get_backend(state.pp_group) != "nccl"

    @torch.inference_mode()
    def layers_forward(
        self, batch: ForwardBatch, kv: PagedKVCache, hidden_in: torch.Tensor | None
    ) -> torch.Tensor:
        """Embedding (first stage) and this stage's layers: hidden states ``[T, hidden]``."""
        x = self.model.embed(batch) if hidden_in is None else hidden_in
        if self.tp is not None:
            return self.tp.run_layers(x, batch, kv)
        return self.model.run_layers(x, batch, kv)

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Last stage: logits from the whole batch's hidden states (None off the head rank)."""
        return self.model.compute_logits(x, batch) if self.model.part.head else None

    def recv_hidden(self, num_tokens: int, step: int = -1) -> torch.Tensor:
        """Receive this step's input from the previous stage; the wait is a ``pp_bubble`` row."""
        st = self.state
        src = st.stage_peer(st.pp_rank - 1)
        with torch.inference_mode():
            x = torch.empty(
                num_tokens, self.model.cfg.hidden_size, dtype=self.model.dtype, device=st.device
            )
        work = dist.irecv(x, src=src, group=st.pp_group)
        assert work is not None  # None only for ranks outside the group
        timed_wait(
            p2p_ready(work, self.timeout_s, self._host_blocking),
            registry=self.registry,
            waiter=f"rank{st.rank}",
            what=f"hidden states of step {step}",
            signaller=f"pp stage {st.pp_rank - 1} (rank {src})",
            boundary=PP_BUBBLE,
            timeout_s=self.timeout_s,
            buf=self.buf,
            stream=COMM_STREAM,
            rank=st.rank,
            step=step,
        )
        return x

    def send_hidden(self, x: torch.Tensor, step: int = -1) -> None:
        """Start sending ``x`` to the next stage; :meth:`flush` waits for it."""
        st = self.state
        x = x.contiguous()
        work = dist.isend(x, dst=st.stage_peer(st.pp_rank + 1), group=st.pp_group)
        assert work is not None
        self._sends.append((work, x, step))

    def flush(self) -> None:
        """Wait until every started send completed (timed and registered, not a probe row: the
        sender's wait is the receiver's bubble, already recorded there)."""
        st = self.state
        dst = st.stage_peer(st.pp_rank + 1)
        while self._sends:
            work, _, step = self._sends[0]
            timed_wait(
                p2p_ready(work, self.timeout_s, self._host_blocking),
                registry=self.registry,
                waiter=f"rank{st.rank}",
                what=f"send of hidden states of step {step}",
                signaller=f"pp stage {st.pp_rank + 1} (rank {dst})",
                boundary=PP_BUBBLE,
                timeout_s=self.timeout_s,
                rank=st.rank,
                step=step,
            )
            self._sends.pop(0)
