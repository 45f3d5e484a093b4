"""The scheduling thread's own cost of a round's host work, two revisions alternated.

    python bench/bench_round_host.py --a REV [--b REV] [--repeats 9] [--rows 64] [--rounds 400]

Whole runs are too noisy here to show a few percent (BENCHMARKS.md: whole-run pairs spread
0.64-1.30 on this VM), so this times, in the thread's own CPU time, exactly the host code a
round runs around the device, for a batch of `--rows` decoding requests that ask for nothing
special: step 4's `Executor.prepare` and the device-process op it becomes (pickled, as the
pipe does), step 5's `collect` of the sampled tokens (through whatever each revision puts
between the device's answer and collect), and the sender's `_deliver` with the tiny
preset's tokenizer. Each revision runs in its own process from its own git worktree
(bench/out/ab/, as bench_ab.py), the order alternating; each process reports the median ns
per round over `--rounds` rounds, and the summary is the median of the B/A ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_ab import alternated  # noqa: E402

CHILD = r'''
import inspect, json, pickle, sys, time
from scheduler.core.batch import ScheduledChunk
from scheduler.core.collect import collect, launched
from scheduler.core.memory_manager import MemoryManager
from scheduler.core.request import ReqSample, Request, RequestStatus, SamplingParams
from scheduler.core.request_manager import RequestManager
from scheduler.device.device_process import RemoteDevice
from scheduler.device.executor import Executor
from scheduler.hops.sender import Sender, StepOutput
from scheduler.hops.tokenizer import Tokenizer
from scheduler.model.presets import resolve_model
from probes.waits import WaitRegistry

rows, rounds = int(sys.argv[1]), int(sys.argv[2])
new_api = "out" in inspect.signature(collect).parameters
mm = MemoryManager(rows * 80, 16)
rm = RequestManager()
reqs = []
for i in range(rows):
    prompt = [(7 * i + j) % 250 + 3 for j in range(100)]
    r = rm.enqueue(ReqSample(f"r{i}", prompt, len(prompt), SamplingParams(100000, ignore_eos=True), 0))
    r.block_table = mm.allocate(r.request_id, 16 * 70)
    rm.admit(r)
    r.status = RequestStatus.RUNNING
    r.output_ids = [5]
    r.num_computed = len(prompt)
    r.first_token_ns = 1
    reqs.append(r)
ex = Executor(RemoteDevice(), 16, 0, {}, WaitRegistry(), 5.0, None)
sender = Sender(Tokenizer(resolve_model("tiny")), [])
sender.queue.put(None)  # its thread ends; _deliver is timed here, on this thread
finish = lambda req, reason: None
times = []
for step in range(1, rounds + 1):
    chunks = [ScheduledChunk(r, r.num_computed, 1, True, 0) for r in reqs]
    t0 = time.thread_time_ns()
    prepared = ex.prepare(chunks)
    slots = ex.alloc_slots(len(prepared.sampled))
    op = RemoteDevice().forward_work(prepared, slots, step, [])
    pickle.dumps(op.payload)
    launched(chunks, prepared.sampled, slots)
    toks = [(step * 13 + i) % 250 + 3 for i in range(len(slots))]
    out = StepOutput(step)
    if new_api:
        from scheduler.model.sampling import SampledLists
        results, scores = prepared.results(SampledLists(toks), slots)
        collect(results, chunks, step, 0, mm, rm, frozenset(), finish, out, scores)
    else:
        res = ((c, slot, tok) for c, tok, slot in zip(prepared.sampled, toks, slots, strict=True))
        collect(res, chunks, step, 0, mm, rm, frozenset(), finish, out.tokens, out.prompts)
    sender._deliver(out)
    times.append(time.thread_time_ns() - t0)
times.sort()
print(json.dumps({"median_ns": times[len(times) // 2], "new_api": new_api}))
'''


def one(src: Path, rows: int, rounds: int) -> float:
    p = subprocess.run([sys.executable, "-c", CHILD, str(rows), str(rounds)], cwd=src, capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SystemExit(f"{src}: {p.stderr.strip()[-600:]}")
    return float(json.loads(p.stdout.strip().splitlines()[-1])["median_ns"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", default=None)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=400)
    a = ap.parse_args()
    median = alternated(lambda src: one(src, a.rows, a.rounds) / 1e3, a.a, a.b, a.repeats, "us per round")
    print(f"median B/A over {a.repeats} repeats: {median:.3f} (host work of a round of {a.rows} decodes, the "
          f"scheduling thread's CPU; A = {a.a}, B = {a.b or 'working tree'})")


if __name__ == "__main__":
    main()
