"""Tensor- and pipeline-parallel model execution over torch.distributed (model level).

``group`` builds the process groups (:class:`ParallelState`, passed explicitly, never global),
``tp`` shards a checkpoint Megatron-style and runs the layers (optionally overlapping each
all-reduce with the other half of the batch), ``comm`` is the observable all-reduce, ``pp`` the
pipeline stage primitives, and ``runner.ShardedModel`` puts one rank's share together.

The runtime of ``mstrace run --tp N --pp M`` (imported by name, not re-exported here):
``launch`` starts and stops the ranks and holds what they share at start-up (clock handshake,
run spec, collectives log), ``batch_wire`` is the per-round batch broadcast, ``coordinator``
is rank 0's side (the engine's hooks call it) and ``worker`` every other rank's entry point.
"""

from .comm import COMM_TIMEOUT_S, AllReduce, CollectiveRecord, PendingAllReduce
from .group import ParallelState, destroy, init_distributed
from .pp import PipelineStage, stage_layers, stage_part
from .runner import ShardedModel
from .tp import (
    TPRunner,
    kv_heads_for_rank,
    slice_batch,
    split_row,
    tp_config,
    tp_shard_fn,
)

__all__ = [
    "COMM_TIMEOUT_S",
    "AllReduce",
    "CollectiveRecord",
    "ParallelState",
    "PendingAllReduce",
    "PipelineStage",
    "ShardedModel",
    "TPRunner",
    "destroy",
    "init_distributed",
    "kv_heads_for_rank",
    "slice_batch",
    "split_row",
    "stage_layers",
    "stage_part",
    "tp_config",
    "tp_shard_fn",
]
