"""What asking for logprobs costs a run, in alternated pairs from one tree.

    python bench/bench_logprobs.py [--pairs 7] [--requests 64] [--model tiny] [--k 5]

One synthetic workload (the `run` default's lengths, seeded) is written twice as JSONL, as a
user writes a workload: once as it is, once with every request asking `logprobs: K` and
`prompt_logprobs: K` (echo's scoring: every prompt position's logits and log_softmax too).
Each pair runs `mstrace run --workload` on both, the order alternating pair by pair, and
reads output tok/s and the scheduling thread's CPU per round (bench_ab.py's `run`). The
median of the asked/plain ratios is the cost of asking. What a run that asks for none pays
for the feature is bench_ab.py's comparison with the revision before it (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_ab import OUT, REPO, run  # noqa: E402


def workloads(model: str, requests: int, k: int) -> tuple[Path, Path]:
    from scheduler.harness.workload import SyntheticSpec, save_workload, synthetic_workload
    from scheduler.model.config import ModelConfig
    from scheduler.model.presets import resolve_model

    mc = ModelConfig.from_file(resolve_model(model) / "config.json")
    specials = set(mc.eos_token_id) | ({mc.bos_token_id} if mc.bos_token_id is not None else set())
    items = synthetic_workload(SyntheticSpec(requests), mc.vocab_size, specials)  # `run`'s default lengths
    plain, asked = OUT / "lp-plain.jsonl", OUT / "lp-asked.jsonl"
    save_workload(items, plain)
    lines = [json.loads(line) for line in plain.read_text().splitlines()]
    asked.write_text("".join(json.dumps({**d, "logprobs": k, "prompt_logprobs": k}) + "\n" for d in lines))
    return plain, asked


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--k", type=int, default=5)
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    plain, asked = workloads(a.model, a.requests, a.k)
    flags = {w: ["--model", a.model, "--workload", str(p)] for w, p in (("plain", plain), ("asked", asked))}
    run(REPO, OUT / "warm", flags["plain"])
    ratios, cpu = [], []
    for i in range(a.pairs):
        order = ("plain", "asked") if i % 2 == 0 else ("asked", "plain")
        res = {w: run(REPO, OUT / f"lp-{w}", flags[w]) for w in order}
        ratios.append(res["asked"][0] / res["plain"][0])
        cpu.append(res["asked"][1] / res["plain"][1])
        print(f"pair {i + 1} ({order[0]} first): plain {res['plain'][0]:.1f}  asked {res['asked'][0]:.1f} tok/s  "
              f"asked/plain {ratios[-1]:.3f} | scheduling-thread CPU per round asked/plain {cpu[-1]:.3f}", flush=True)
    print(f"median asked/plain over {a.pairs} pairs: throughput {statistics.median(ratios):.3f}, scheduling-thread "
          f"CPU per round {statistics.median(cpu):.3f} (model {a.model}, {a.requests} requests, logprobs and "
          f"prompt_logprobs {a.k})")


if __name__ == "__main__":
    main()
