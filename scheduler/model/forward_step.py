"""Step 4 on the device, once for every backend: resolve the overlap placeholders, run the
model, sample (with the logprobs asked for), publish the tokens to the future ring.

The local threads and CUDA streams (`device/local_device.py`), the device process
(`device/device_server.py`), TP/PP rank 0 (through `parallel/coordinator.py`) and the other
ranks (`parallel/worker.py`) all call `forward_step`; they differ only in the model they
pass (a whole model, a shard that broadcasts first) and where tokens come from when their
model returns no logits (a pipeline stage before the last).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

from scheduler.model.forward_batch import resolve_placeholders
from scheduler.model.sampling import Sampled, publish, sample_batch

if TYPE_CHECKING:
    import torch

    from scheduler.model.forward_batch import ForwardBatch
    from scheduler.model.kv_cache import PagedKVCache
    from scheduler.model.penalties import LogitsAdjust

# the model as a backend runs it: logits, or None where another rank computes them
ModelStep = Callable[["ForwardBatch", "PagedKVCache"], "torch.Tensor | None"]


class SamplingArgs(NamedTuple):
    """Per sampled row, what the sampler needs beside the logits. A tuple: it crosses the
    device process's pipe every round, and a dataclass pickles through Python code."""

    temperatures: Sequence[float]
    top_ps: Sequence[float]
    seeds: Sequence[int | None]  # each row's draw seed; None = greedy
    logprobs: Sequence[int] = ()  # top-k asked per row, -1 = none; () when no row asks
    score_k: int = -1  # the most alternatives a scored (prompt) row asks for; -1 = none
    adjust: LogitsAdjust | None = None  # penalties, biases, min_tokens


@contextmanager
def _gpu_attention() -> Iterator[None]:
    """SDPA without cuDNN's backend. torch 2.11 tries cuDNN first for a masked SDPA on Hopper
    and later, and cuDNN builds an execution plan for every new shape (tens of milliseconds
    each, on the launching thread); the engine's attention shapes change every round (decode
    length groups, context lengths, prefill chunks). The memory-efficient kernel takes any
    shape and mask at no such cost; a masked prefill that also asks for GQA may fall to the
    math kernel (bench/gpu_check.py reports both choices). The switch is the process's; it is
    set back after the model."""
    import torch

    was = torch.backends.cuda.cudnn_sdp_enabled()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def forward_step(model: ModelStep, fb: ForwardBatch, kv: PagedKVCache, sampling: SamplingArgs,
                 future: torch.Tensor | None = None, slots: Sequence[int] = (), has_placeholders: bool = False,
                 receive: Callable[[], torch.Tensor] | None = None) -> Sampled | None:
    """One batch's device work. `receive`: the tokens, when `model` returns no logits on this
    rank (rank 0 of a pipeline); without it such a rank has nothing to give back (None)."""
    if has_placeholders:
        assert future is not None, "placeholders resolve from the future ring"
        resolve_placeholders(fb, future)
    if fb.input_ids.device.type == "cuda":
        with _gpu_attention():
            logits = model(fb, kv)
    else:
        logits = model(fb, kv)
    if logits is not None:
        s = sampling
        out = sample_batch(logits, fb.num_sampled, s.temperatures, s.top_ps, s.seeds, s.logprobs, fb.score_targets,
                           s.score_k, s.adjust, future)
    elif receive is not None:
        out = Sampled(receive())
    else:
        return None
    if slots:
        assert future is not None, "tokens publish to the future ring"
        publish(future, slots, out.tokens)
    return out
