"""Send the prompts on vLLM's arrival schedule and collect the replies.

Arrivals: --request-rate inf sends everything at t=0; otherwise gaps are drawn from
a gamma distribution of shape `burstiness` and mean 1/rate (burstiness 1 is a
Poisson process; below 1 burstier, above 1 steadier), as `vllm bench serve` does.
--max-concurrency caps the requests in flight, and the connection pool with them.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable

from viewer.bench_serve.datasets import Prompt
from viewer.bench_serve.http_client import Endpoint, Reply


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    # `not x > 0` refuses NaN too: a NaN rate sent everything at once, a NaN shape hung gammavariate
    if not rate > 0 or not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError("--request-rate must be positive (inf: all at once) and --burstiness positive and finite")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def body_for(p: Prompt, model: str, chat: bool, ignore_eos: bool) -> dict[str, object]:
    b: dict[str, object] = {"model": model, "max_tokens": p.output_len, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    b.update(p.body)  # a workload item's own fields over the defaults
    if ignore_eos:  # (the flag asks it of every request)
        b["ignore_eos"] = True
    if chat:  # (the command refuses token-id prompts for chat)
        b.pop("add_special_tokens", None)  # a chat template writes its own
        b["messages"] = [{"role": "user", "content": p.text}]
    else:
        b["prompt"] = p.text
    return b


async def _run(ep: Endpoint, prompts: list[Prompt], offsets: list[float], model: str, chat: bool,
               ignore_eos: bool, max_concurrency: int | None,
               on_done: Callable[[Reply], None]) -> tuple[list[Reply], float]:
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with ep.session(max_concurrency) as session:
        start = time.perf_counter()

        async def one(p: Prompt, at: float) -> Reply:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                r = await ep.stream(session, body_for(p, model, chat, ignore_eos), chat)
            else:
                async with gate:
                    r = await ep.stream(session, body_for(p, model, chat, ignore_eos), chat)
            on_done(r)
            return r

        replies = await asyncio.gather(*(one(p, at) for p, at in zip(prompts, offsets, strict=True)))
        return list(replies), time.perf_counter() - start


def run(ep: Endpoint, prompts: list[Prompt], offsets: list[float], model: str, chat: bool, ignore_eos: bool,
        max_concurrency: int | None, on_done: Callable[[Reply], None]) -> tuple[list[Reply], float]:
    return asyncio.run(_run(ep, prompts, offsets, model, chat, ignore_eos, max_concurrency, on_done))
