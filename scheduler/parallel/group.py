"""Process groups for tensor x pipeline parallelism, as one explicit object.

Rank layout: ``rank = pp_rank * tp_size + tp_rank``.  The TP ranks of a stage are consecutive,
which on one host keeps a stage's all-reduces between neighbouring devices, and the next stage's
peer of a rank is ``rank + tp_size``.  Nothing here is global: whoever needs the groups is given
the :class:`ParallelState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Also bounds every gloo/nccl operation that is not waited through probes.waits.timed_wait
# (process-group setup, barriers): generous, because ranks load weights at different speeds.
INIT_TIMEOUT_S = 60.0
# The TP and PP groups' own timeout. gloo applies a group's timeout to each of its
# collectives, under the waiter's: every op on these groups is waited through timed_wait
# (the hard wait timeout, and --on-stall), which must be the bound that ends it.
GROUP_OP_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(slots=True)
class ParallelState:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    rank: int
    world_size: int
    tp_group: dist.ProcessGroup | None  # None when tp_size == 1 (no collectives)
    pp_group: dist.ProcessGroup | None  # None when pp_size == 1
    device: torch.device

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """One process, no torch.distributed."""
        return cls(0, 1, 0, 1, 0, 1, None, None, torch.device(device))

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def logits_rank(self) -> int:
        """The one rank that computes logits: TP rank 0 of the last stage (it samples)."""
        return (self.pp_size - 1) * self.tp_size

    def stage_peer(self, pp_rank: int) -> int:
        """Global rank of this rank's TP position in stage ``pp_rank``."""
        return pp_rank * self.tp_size + self.tp_rank


def init_distributed(
    backend: str | None,
    rank: int,
    world_size: int,
    init_method: str,
    *,
    tp_size: int | None = None,
    pp_size: int = 1,
    timeout_s: float = INIT_TIMEOUT_S,
) -> ParallelState:
    """Join the world and build the TP and PP groups.

    ``backend`` None picks nccl when CUDA is available, gloo otherwise; ``tp_size`` defaults to
    ``world_size // pp_size``.  Every rank must call this with the same sizes: ``new_group`` is
    collective over the whole world, so all groups are created on all ranks in the same order.
    """
    tp_size = tp_size or world_size // pp_size
    if tp_size < 1 or pp_size < 1 or tp_size * pp_size != world_size:
        raise ValueError(f"tp_size {tp_size} x pp_size {pp_size} != world_size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = pp_group = None
    timeout = timedelta(seconds=GROUP_OP_TIMEOUT_S)
    if tp_size > 1:
        for p in range(pp_size):
            g = dist.new_group([p * tp_size + t for t in range(tp_size)], timeout=timeout)
            if p == pp_rank:
                tp_group = g
    if pp_size > 1:
        for t in range(tp_size):
            g = dist.new_group([p * tp_size + t for p in range(pp_size)], timeout=timeout)
            if t == tp_rank:
                pp_group = g
    return ParallelState(
        tp_rank, tp_size, pp_rank, pp_size, rank, world_size, tp_group, pp_group, device
    )


def destroy() -> None:
    """Tear down every process group of this process (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
