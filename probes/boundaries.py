"""The names of the sync boundaries. They appear in the probes table and in
every report; once shipped, a name never changes."""

from __future__ import annotations

from typing import Final

SCHEDULER_BARRIER: Final = "scheduler_barrier"  # host waits for the device's result of a step
DEVICE_COMPUTE: Final = "device_compute"  # device stream busy with model work (the reference quantity)
ALL_REDUCE: Final = "all_reduce"  # a rank waits in a collective (TP)
BOOKKEEPING: Final = "bookkeeping"  # host updates block table, ref counts, free list, request state
RESPONSE_SEND: Final = "response_send"  # hand-off of new tokens to the sender path
RESPONSE_DELIVER: Final = "response_deliver"  # the sender thread detokenizes and delivers one round
BATCH_BROADCAST: Final = "batch_broadcast"  # rank 0 ships the batch description to other ranks
KV_FENCE: Final = "kv_fence"  # freeing/reusing blocks waits for device work that still reads them
TOKENIZE: Final = "tokenize"  # a request's time in the tokenizer pool
BATCH_PREPARE: Final = "batch_prepare"  # host builds the step's device tensors (launch cost)
STREAM_WAIT: Final = "stream_wait"  # a stream waits for an event recorded on another stream
PREFILL_STAGGER: Final = "prefill_stagger"  # deliberate delay before prefill work (spreads prefill launches apart)
DEFRAG: Final = "defrag"  # scheduling paused while live KV blocks move to the low end
IDLE: Final = "idle"  # the engine has nothing to run and waits for arrivals (not a cycle cost)
PP_BUBBLE: Final = "pp_bubble"  # a pipeline stage waits for its input hidden states from the previous stage
# Imported profiler traces (importers/): a device stream busy with non-compute work.
DEVICE_COMM: Final = "device_comm"  # a communication kernel (NCCL/RCCL) runs on a device stream
DEVICE_COPY: Final = "device_copy"  # a memcpy or memset runs on a device stream

ALL: Final = (
    SCHEDULER_BARRIER, DEVICE_COMPUTE, ALL_REDUCE, BOOKKEEPING, RESPONSE_SEND,
    BATCH_BROADCAST, KV_FENCE, RESPONSE_DELIVER, TOKENIZE, BATCH_PREPARE, STREAM_WAIT, PREFILL_STAGGER, DEFRAG, IDLE,
    PP_BUBBLE, DEVICE_COMM, DEVICE_COPY,
)

# How far each boundary's cost can be removed (the report's `removable` column).
REMOVABLE: Final[dict[str, str]] = {
    SCHEDULER_BARRIER: "partly overlappable",
    DEVICE_COMPUTE: "not removable",
    ALL_REDUCE: "partly overlappable",
    BOOKKEEPING: "parallel to device",
    RESPONSE_SEND: "should be async",
    RESPONSE_DELIVER: "off-thread already",
    BATCH_BROADCAST: "overlappable",
    KV_FENCE: "defer the free",
    TOKENIZE: "off-thread already",
    BATCH_PREPARE: "overlappable",
    STREAM_WAIT: "remove the dependency",
    PREFILL_STAGGER: "tunable (--prefill-stagger-us)",
    DEFRAG: "rare (free > 30%, no run fits)",
    IDLE: "not a cost",
    PP_BUBBLE: "shrinks with more micro-batches in flight",
    DEVICE_COMM: "overlap with compute",
    DEVICE_COPY: "overlap, or avoid the copy",
}
