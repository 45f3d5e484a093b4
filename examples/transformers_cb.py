"""transformers' continuous batching (`model.generate_batch`) traced through mstrace's public
probes API, without modifying transformers: its batch processor's methods are wrapped while
the run lasts, and put back after.

    python examples/transformers_cb.py --out traces/hf-cb [--requests 16] [--max-new-tokens 24]
    mstrace report traces/hf-cb      # its rounds and both views
    mstrace stalls traces/hf-cb      # the waits the watchdog saw (none, on a healthy run)

What each row is (transformers 5.x, generation/continuous_batching/continuous_api.py):
  * a round: one `ContinuousBatchProcessor.prepare_next_batch` that found work, through its
    `update_batch` (a prepare that finds none is no round);
  * bookkeeping: scheduling in `prepare_next_batch` (around the tensor preparation) and `update_batch`;
  * batch_prepare: `inputs_and_outputs.prepare_batch_tensors`;
  * device_compute and scheduler_barrier: `_generation_step` (forward, sampling, the copy of the
    tokens back). On the CPU the scheduling thread computes the forward itself, so the same
    interval is the device's compute and the host's wait for it; on a GPU you would time the
    device side with CUDA events and wait through `Tracer.wait`.
The model is mstrace's `tiny` preset by default (a Llama with random weights, generated here:
nothing is downloaded), or any local Llama-family folder (`--model PATH`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mstrace

PAGE = 256  # tokens a KV page holds (transformers' default)


def load_model(model: str) -> Any:
    """An mstrace preset (`tiny`, `default`: generated here, nothing downloaded) or a local
    Llama-family folder, in float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if not path.is_dir():
        from scheduler.model.presets import ensure_preset

        path = ensure_preset(model)
    return AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


@contextmanager
def instrumented(tracer: mstrace.Tracer) -> Iterator[None]:
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
    from transformers.generation.continuous_batching.requests import RequestStatus

    cls = ContinuousBatchProcessor
    orig = {name: getattr(cls, name) for name in ("prepare_next_batch", "_generation_step", "update_batch")}
    state: dict[str, Any] = {"round": None, "batch": {}}

    def prepare_next_batch(self: Any) -> bool:
        io = self.inputs_and_outputs
        if not getattr(io, "_mstrace_wrapped", False):  # the IO object's own method, wrapped once
            tensors = io.prepare_batch_tensors

            def prepare_batch_tensors(*args: Any, **kwargs: Any) -> Any:
                reqs = kwargs.get("requests_in_batch", args[0] if args else [])
                # a request still in its prompt feeds it (a chunk of it) this step: more than one query token
                pre = [f.query_length for f in reqs if f.query_length > 1 or f.state.status == RequestStatus.PREFILLING]
                state["batch"] = {"prefill_reqs": len(pre), "decode_reqs": len(reqs) - len(pre),
                                  "prefill_tokens": sum(pre), "decode_tokens": len(reqs) - len(pre)}
                t0 = mstrace.now_ns()
                try:
                    return tensors(*args, **kwargs)
                finally:
                    state["tensors"] = (t0, mstrace.now_ns())

            io.prepare_batch_tensors = prepare_batch_tensors
            io._mstrace_wrapped = True
        r = tracer.begin_round()
        state["tensors"] = None
        t0 = mstrace.now_ns()
        found = orig["prepare_next_batch"](self)
        t1 = mstrace.now_ns()
        if not found:
            tracer.cancel_round(r)
            return found
        state["round"] = r
        a, b = state["tensors"] or (t1, t1)
        tracer.record(mstrace.BOOKKEEPING, t0, a - t0)
        tracer.record(mstrace.BATCH_PREPARE, a, b - a)
        tracer.record(mstrace.BOOKKEEPING, b, t1 - b)
        return found

    def generation_step(self: Any, model: Any) -> None:
        t0 = mstrace.now_ns()
        try:
            orig["_generation_step"](self, model)
        finally:
            t1 = mstrace.now_ns()
            tracer.device(t0, t1 - t0, stream="main")
            tracer.record(mstrace.SCHEDULER_BARRIER, t0, t1 - t0)
            state["device_ns"] = t1 - t0

    def update_batch(self: Any) -> None:
        with tracer.probe(mstrace.BOOKKEEPING):
            orig["update_batch"](self)
        r = state.pop("round", None)
        if r is not None:
            tracer.end_round(r, device_ns=state.get("device_ns", 0), **state["batch"])

    cls.prepare_next_batch = prepare_next_batch  # type: ignore[method-assign]
    cls._generation_step = generation_step  # type: ignore[method-assign]
    cls.update_batch = update_batch  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, fn in orig.items():
            setattr(cls, name, fn)


def main(argv: list[str] | None = None) -> None:
    import numpy as np
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny", help="an mstrace preset name or a local model folder")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    inputs = [rng.integers(1, vocab, int(rng.integers(8, 64))).tolist() for _ in range(args.requests)]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # A cache sized to this workload: left to itself, transformers takes 90% of the free memory
    # (on the CPU, the machine's RAM), and zeroing it took most of the run (30 s of 35 here).
    longest = max(map(len, inputs)) + args.max_new_tokens
    cb = ContinuousBatchingConfig(num_blocks=args.requests * -(-longest // PAGE), page_size=PAGE,
                                  max_batch_tokens=max(256, longest))
    # GenerationOutput's times are time.perf_counter(): CLOCK_MONOTONIC on Linux, as mstrace's clock
    offset = mstrace.now_ns() - time.perf_counter_ns()
    with mstrace.Tracer(args.out, engine=f"transformers {transformers.__version__} generate_batch",
                        config={"mode": "continuous batching", "max_new_tokens": args.max_new_tokens}) as tr, \
            instrumented(tr):
        outputs = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb,
                                      record_timestamps=True, progress_bar=False,
                                      warmup=False)  # warmup captures CUDA graphs: nothing to capture here
        for rid, o in outputs.items():
            ts = [offset + int(t * 1e9) for t in (o.timestamps or [])]
            tr.request(rid, arrival_ns=offset + int(o.created_time * 1e9), first_token_ns=ts[0] if ts else 0,
                       finish_ns=ts[-1] if ts else offset + int(o.lifespan[1] * 1e9),
                       prompt_len=len(o.prompt_ids), output_len=len(o.generated_tokens),
                       finish_reason="length" if len(o.generated_tokens) >= args.max_new_tokens else "eos",
                       token_ns=ts)
    print(f"{args.out}: {len(outputs)} requests; next: mstrace report {args.out}")


if __name__ == "__main__":
    main()
